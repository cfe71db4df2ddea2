"""FCFS continuous batching with chunked prefill, mixed prefill/decode steps and retraction.

Each step: running decodes first (one token each; when pages run out the most recently
admitted request is retracted and re-queued), then running prefills continue their next
chunk, then waiting requests are admitted in arrival order while the prefill token budget
(``chunked_prefill_size``), the running limit and memory allow.
"""

from __future__ import annotations

import collections

from hicache_jax.config import EngineConfig
from hicache_jax.request import Req, Status
from hicache_jax.scheduler.cache_adapter import CacheAdapter
from hicache_jax.scheduler.plan import StepPlan, WorkItem


class Scheduler:
    def __init__(self, cfg: EngineConfig, adapter: CacheAdapter, storage=None):
        self.cfg = cfg
        self.adapter = adapter
        self.storage = storage  # L3 tier: its prefetch policy gates admission
        self.P = cfg.page_size
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.num_retractions = 0

    # ---- queue --------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                return r
        for r in self.running:
            if r.rid == rid:
                self.running.remove(r)
                self.adapter.release(r)
                return r
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -----------------------------------------------------------------------
    def chunk_end(self, req: Req, start: int, budget: int) -> int:
        """Where this step's chunk of ``req`` ends: its budget, the next multiple of
        ``chunked_prefill_size``, and (Mamba) the prompt's last page boundary, so a state
        snapshot lands exactly where the same prompt's match will want one."""
        total = len(req.input_ids) + len(req.output_ids)
        chunk = self.cfg.chunked_prefill_size
        end = min(total, start + budget, (start // chunk + 1) * chunk)
        if self.adapter.has_mamba:
            boundary = (total - 1) // self.P * self.P
            if start < boundary < end:
                end = boundary
        return end

    def schedule(self) -> StepPlan | None:
        plan = StepPlan(items=[])
        self._schedule_decodes(plan)
        budget = self.cfg.chunked_prefill_size
        for req in self.running:
            if req.remaining > 1 and budget > 0:
                end = self.chunk_end(req, req.num_computed, budget)
                if self.adapter.ensure_pages(req, end):
                    self._add(plan, req, end)
                    budget -= end - req.num_computed
        if self.storage is not None:
            self.storage.poll()
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            if self.storage is not None and not self.storage.ready(req.rid):
                continue  # still prefetching from L3: later requests may go first
            match = self.adapter.match(req)
            end = self.chunk_end(req, match.end, budget)
            if not self.adapter.admit(req, match, end):
                break  # out of memory: FCFS, the rest wait behind it
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            self._add(plan, req, end)
            budget -= end - match.end
        return plan if plan.items else None

    def _schedule_decodes(self, plan: StepPlan) -> None:
        while True:
            decodes = [r for r in self.running if r.remaining == 1]
            if all(self.adapter.ensure_pages(r, r.num_computed + 1) for r in decodes):
                break
            if not self._retract_one():
                raise RuntimeError("out of KV pages with a single running request; raise max_total_tokens")
        for r in decodes:
            self._add(plan, r, r.num_computed + 1)

    def _retract_one(self) -> bool:
        """Put the most recently admitted request back at the head of the queue. Its
        computed prefix goes to the tree (evictable), so it resumes cheaply; its outputs
        are kept, and per-token seeds make the rest come out the same."""
        if len(self.running) <= 1:
            return False
        req = self.running.pop()
        self.adapter.finish(req)
        req.status = Status.WAITING
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        return True

    def _add(self, plan: StepPlan, req: Req, end: int) -> None:
        start = req.num_computed
        item = WorkItem(req, start, end, has_initial_state=start > 0)
        if req.restore_from is not None:
            plan.copies_before.append((req.restore_from, req.state_slot))
            req.restore_from = None
        if self.adapter.has_mamba and end % self.P == 0 and end > start:
            slot = self.adapter.snapshot_slot(req, end // self.P)
            if slot is not None:
                plan.copies_after.append((req.state_slot, slot))
        plan.items.append(item)
