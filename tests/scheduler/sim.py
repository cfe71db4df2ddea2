"""Scheduler + CacheAdapter + PrefixCache driven as the engine drives them, with the model
step faked, and the checks every step must pass.

The fake model keeps real "KV": each page slot holds the token id written there. A step
reads, through the batch builder's page tables, the context each sequence attends to and
checks it is that sequence's own tokens, then writes its new tokens through the slot
mappings. So a page reused while a request still reads it, a matched prefix pointing at
the wrong pages, or a sliding window missing a page fails the step where it happens.
Sampled tokens depend only on (request, output index), like the engine's per-token
seeds, so a retracted request must finish with the same outputs as if it ran alone.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.cache.radix import path_to
from hicache_jax.config import EngineConfig
from hicache_jax.request import Req, Status
from hicache_jax.runtime.batch_builder import BatchBuilder
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler.cache_adapter import CacheAdapter
from hicache_jax.scheduler.plan import StepPlan
from hicache_jax.scheduler.scheduler import Scheduler
from tests.cache_rules import classic_rules

EMPTY = -1  # a KV slot nothing was written to


def sampled_token(rid: str, index: int) -> int:
    """The fake model's output ``index`` of request ``rid`` (independent of batching)."""
    return 3 + zlib.crc32(f"{rid}:{index}".encode()) % 997


class KvTransfer:
    """Device <-> host copies of the fake KV (one row of ``page_size`` token ids a page)."""

    def __init__(self, kv: dict[str, np.ndarray], page_size: int):
        self.kv = kv
        self.P = page_size

    def read(self, kind, idx):
        return {"kv": np.stack([self.kv[kind][i * self.P : (i + 1) * self.P] for i in idx])}

    def write(self, kind, idx, arrays):
        for i, row in zip(idx, arrays["kv"]):
            self.kv[kind][i * self.P : (i + 1) * self.P] = row


@dataclasses.dataclass
class Setup:
    page_size: int = 4
    chunk: int = 16  # chunked_prefill_size
    max_running: int = 4
    full_pages: int = 64
    window: int | None = None  # sliding window (tokens): adds an "swa" pool
    swa_pages: int | None = None
    host_pages: int = 0  # > 0: an L2 host tier, write-through
    max_pages: int = 64  # page-table width (longest request, in pages)


class Sim:
    def __init__(self, s: Setup):
        self.s = s
        P = s.page_size
        self.P = P
        self.cfg = EngineConfig(
            page_size=P,
            chunked_prefill_size=s.chunk,
            max_running_requests=s.max_running,
            max_total_tokens=s.full_pages * P,
        )
        rules = classic_rules(P, window=s.window)
        pools = {"full": IndexPool(s.full_pages, "full pages")}
        if s.window:
            pools["swa"] = IndexPool(s.swa_pages or s.full_pages, "swa pages")
        self.kv = {k: np.full(p.size * P, EMPTY, np.int64) for k, p in pools.items()}
        host = None
        if s.host_pages:
            host = {k: HostPool(k, s.host_pages, {"kv": ((P,), np.int64)}) for k in pools}
        self.cache = PrefixCache(rules, pools, host=host, transfer=KvTransfer(self.kv, P))
        self.adapter = CacheAdapter(self.cache)
        self.sched = Scheduler(self.cfg, self.adapter)
        self.builder = BatchBuilder(
            page_size=P,
            groups=tuple(pools),
            max_running=s.max_running,
            max_prefill=s.chunk,
            max_pages=s.max_pages,
            vocab_size=512,
        )
        self.finished: list[Req] = []
        self.aborted: list[Req] = []
        self.steps = 0

    # ---- requests -----------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_new: int) -> Req:
        req = Req(
            rid=rid, input_ids=list(prompt), sampling=SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        )
        self.sched.add(req)
        return req

    # ---- one step ------------------------------------------------------------------------
    def step(self, planned=None) -> StepPlan | None:
        """One engine step; ``planned(plan)`` sees the state right after scheduling."""
        plan = self.sched.schedule()
        self.steps += 1
        if planned is not None:
            planned(plan)
        if plan is None:
            return None
        self.run_model(plan)
        for item in plan.items:  # the engine's postprocess, minus logprobs
            req = item.req
            req.num_computed = item.end
            if item.samples:
                req.output_ids.append(sampled_token(req.rid, len(req.output_ids)))
                if len(req.output_ids) >= req.sampling.max_new_tokens:
                    self.sched.finish(req)
                    req.status = Status.FINISHED
                    self.finished.append(req)
                    continue
            self.adapter.after_step(req, insert=item.num_tokens > 1 or item.start < req.input_len)
        if self.cache.host:
            self.cache.backup_pending()
        return plan

    def run_model(self, plan: StepPlan) -> None:
        """Read each sequence's context through its page tables, then write its tokens."""
        inputs = self.builder.build(plan)
        batch = inputs.batch
        P, W = self.P, self.s.window
        for s, item in enumerate(plan.items):
            fill = np.asarray(item.req.fill_ids)
            for g, table in batch.page_tables.items():
                lo = 0 if g == "full" else max(0, item.start - W + 1)
                q = np.arange(lo, item.start)
                got = self.kv[g][table[s, q // P] * P + q % P]
                if not (got == fill[q]).all():
                    bad = q[got != fill[q]][:4]
                    raise AssertionError(
                        f"step {self.steps}: request {item.req.rid} reads {g} KV {got[bad - lo]} at "
                        f"positions {bad}, not its tokens {fill[bad]}"
                    )
        for g, slots in batch.slot_mappings.items():
            n = int(batch.cu_q_lens[batch.num_seqs])
            assert (slots[:n] >= 0).all(), f"{g}: a token of the step has no slot"
            assert len(set(slots[:n].tolist())) == n, f"{g}: two tokens of one step share a slot"
            self.kv[g][slots[:n]] = batch.input_ids[:n]

    # ---- invariants -----------------------------------------------------------------------
    def check_ownership(self) -> None:
        """Every used page owned exactly once: by a tree, or by the running request whose
        page list marks it its own (counted here from the requests, not from the pools);
        every borrowed page is the one the locked tree path holds."""
        held: dict[str, list[int]] = {k: [] for k in self.cache.pools}
        for r in self.sched.running:
            path = path_to(r.cache.last_node) if r.cache.last_node is not None else []
            assert len(path) == r.cache.num_inserted_pages, (r.rid, len(path), r.cache.num_inserted_pages)
            for kind in ("full", "swa"):
                if kind not in held:
                    continue
                pages, own = r.cache.pages[kind], r.cache.own[kind]
                assert len(pages) == len(own) == r.cache.num_pages
                for j, (p, o) in enumerate(zip(pages, own)):
                    if p is None:
                        continue
                    if o:
                        held[kind].append(p)
                    else:  # borrowed: the tree's page on the request's locked path
                        assert j < len(path), f"{r.rid}: page {j} borrowed but not in the tree"
                        assert path[j].dev.get(kind) == p, f"{r.rid}: {kind} page {j} is not the tree's"
            for node in path:
                assert node.lock_ref > 0, f"{r.rid}: its tree path is not locked"
        for r in list(self.sched.waiting) + self.finished + self.aborted:
            assert not r.cache.num_pages and r.cache.last_node is None and not r.cache.window_locked, (
                f"{r.rid} holds pages"
            )
        self.cache.check_integrity(held)
        if not self.sched.running:
            for node in self.cache.nodes():
                assert node.lock_ref == 0 and node.window_lock == 0, "a lock outlived its requests"
