"""Random request traces for the reliability tests, and a driver that runs one on an engine
with staggered arrivals and compares every output with the request run alone."""

from __future__ import annotations

import dataclasses
import tempfile

import numpy as np
from hypothesis import strategies as st

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.sampling_params import QueueFull

VOCAB = (3, 500)  # token ids drawn here: no BOS/EOS (1, 2) inside prompts


@dataclasses.dataclass(frozen=True)
class TraceReq:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    seed: int
    arrival_step: int  # the engine step at which it is added

    @property
    def sampling(self) -> dict:
        sp = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "ignore_eos": True}
        return sp | ({"seed": self.seed, "top_k": 40} if self.temperature else {})

    @property
    def total(self) -> int:
        return len(self.prompt) + self.max_new_tokens


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(*VOCAB, n).tolist()


@st.composite
def traces(draw, *, max_requests: int = 8, max_len: int = 160):
    """Requests sharing a few random prefixes (cut anywhere), with random suffixes, output
    lengths, greedy or seeded sampling, and arrival steps; lengths lean long, so that
    requests crowd a small pool."""
    shared = [_tokens(1000 + i, draw(st.integers(0, max_len - 8))) for i in range(draw(st.integers(1, 3)))]
    out = []
    for _ in range(draw(st.integers(2, max_requests))):
        base = draw(st.sampled_from(shared))
        base = base[: draw(st.integers(0, len(base)))]
        n = draw(st.one_of(st.integers(1, max_len - len(base)), st.just(max_len - len(base))))
        out.append(
            TraceReq(
                prompt=tuple(base + _tokens(draw(st.integers(0, 2**30)), max(1, n))),
                max_new_tokens=draw(st.integers(1, 12)),
                temperature=draw(st.sampled_from([0.0, 0.0, 0.9])),
                seed=draw(st.integers(0, 1000)),
                arrival_step=draw(st.integers(0, 6)),
            )
        )
    return out


def tier_kwargs(tiers: str, l3_dir: str | None = None) -> dict:
    """EngineConfig fields for ``"l1"``, ``"l2"`` or ``"l3"`` (L1+L2+L3)."""
    if tiers == "l1":
        return {}
    kw = dict(enable_hierarchical_cache=True, hicache_ratio=1.5)
    if tiers == "l3":
        kw |= dict(
            hicache_storage_backend="tensorstore",
            hicache_storage_spec=l3_dir or tempfile.mkdtemp(prefix="hicache-l3-"),
            hicache_storage_prefetch_policy="timeout",
            hicache_prefetch_threshold=0,
        )
    return kw


def run_trace(
    engine: Engine, trace: list[TraceReq], *, max_steps: int = 20_000, check_every: int = 0
) -> list[dict]:
    """Add each request at its arrival step, step until all finish; outputs in trace order."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_step)
    rids: dict[int, str] = {}
    step = 0
    while len(rids) < len(trace) or engine.has_unfinished():
        while len(rids) < len(trace) and trace[order[len(rids)]].arrival_step <= step:
            i = order[len(rids)]
            try:
                rids[i] = engine.add_request(
                    input_ids=list(trace[i].prompt), sampling_params=trace[i].sampling
                )
            except QueueFull:
                break  # as a client would: retry after the engine made room
        engine.step()
        step += 1
        if check_every and step % check_every == 0:
            engine.check_integrity()
        assert step < max_steps, f"no end after {max_steps} steps"
    return [engine.pop_output(rids[i]) for i in range(len(trace))]


_solo_engines: dict = {}


def solo_outputs(cfg: EngineConfig, trace: list[TraceReq]) -> list[list[int]]:
    """Each request alone, without a prefix cache (a plain recompute), on an engine of the
    same shapes as ``cfg`` (so it reuses the compiled programs)."""
    alone = cfg.replace(
        disable_radix_cache=True,
        enable_hierarchical_cache=False,
        hicache_storage_backend=None,
        hicache_storage_spec=None,
    )
    if alone not in _solo_engines:
        _solo_engines[alone] = (Engine(alone), {})
    engine, memo = _solo_engines[alone]
    outs = []
    for r in trace:
        k = (r.prompt, tuple(sorted(r.sampling.items())))
        if k not in memo:
            memo[k] = run_trace(engine, [dataclasses.replace(r, arrival_step=0)])[0]["output_ids"]
        outs.append(memo[k])
    return outs


def assert_all_free(engine: Engine) -> None:
    """After flush_cache: integrity holds and every device and host page is free."""
    assert engine.flush_cache().success, "flush_cache refused with nothing in flight"
    engine.check_integrity()
    for pool in engine.prefix_cache.pools.values():
        assert pool.num_used == 0, f"{pool.name}: {pool.num_used} still used after flush"
    for kind, pool in engine.prefix_cache.host.items():
        assert pool.index.num_used == 0, f"host {kind}: {pool.index.num_used} still used after flush"
