"""Replaying a conversation trace (Mooncake's format, one 512-token block scaled to one
16-token page) with L2 on a small pool: L1 fills with prefixes whose deeper pages live only
in L2; a long request must still get its pages (eviction used to stop at such prefixes and
the engine waited forever). Every request ends with its solo output."""

import os

import pytest

from hicache_jax.bench.traces import prompt_ids, read_trace, scaled_output_length
from hicache_jax.config import EngineConfig
from tests.reliability.test_liveness import check
from tests.reliability.workload import TraceReq

TRACE = os.path.join(
    os.path.dirname(__file__), "..", "..", "benchmarks", "traces", "conversations_small.jsonl"
)


def trace_requests(path: str, per_step: int = 2) -> list[TraceReq]:
    out = []
    for i, r in enumerate(read_trace(path)):
        ids = prompt_ids(r, tokens_per_block=16, vocab=(3, 500))
        out.append(TraceReq(tuple(ids), scaled_output_length(r, tokens_per_block=16), 0.0, 0, i // per_step))
    return out


@pytest.mark.parametrize("tiers", ["l2", "l1"])
def test_conversation_trace_replays(tiers):
    trace = trace_requests(TRACE)
    cfg = EngineConfig(
        preset="tiny",
        page_size=16,
        chunked_prefill_size=64,
        max_running_requests=8,
        max_total_tokens=48 * 16,
        **(dict(enable_hierarchical_cache=True, hicache_ratio=2.0) if tiers == "l2" else {}),
    )
    assert max(r.total for r in trace) <= cfg.max_total_tokens
    engine = check(cfg, trace)
    assert engine.stats["cached_tokens"] > 0
