"""Bounded memory around L3: the write queue holds at most its byte budget (the rest is
skipped and counted, and the engine never waits on it), and prefetches hold host rows from
the moment they are issued."""

from __future__ import annotations

import time

from tests.cache.l3_helpers import SAMPLING, assert_same_as_recompute, prompt, run
from tests.reliability.conftest import faulty


def _finish(llm, rids: list[str], timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while llm.engine.has_unfinished():
        assert time.monotonic() < deadline, "requests did not finish"
        llm.engine.step()
    return [llm.engine.pop_output(r) for r in rids]


def test_write_queue_is_bounded_in_bytes_and_never_blocks(make_llm):
    cap_mb = 0.1  # about 12 of the tiny preset's 8 KiB pages
    llm = make_llm(hicache_storage_write_queue_mb=cap_mb, hicache_storage_timeout_s=30.0)
    run(llm, prompt(seed=90))  # compiled and written before the store hangs
    assert llm.flush_cache().success
    written = llm.engine.metrics()["l3_writes"]
    store = faulty(llm)
    store.hang("put")  # nothing leaves the queue
    for seed in (91, 92):  # 2 prompts x 16 pages x 2 kinds = 64 page writes asked for
        t0 = time.monotonic()
        run(llm, prompt(seed=seed))
        assert time.monotonic() - t0 < 5.0  # the engine never waited on the queue
    stats = llm.engine.metrics()
    assert 0 < stats["l3_pending_write_bytes"] <= cap_mb * 2**20
    assert stats["l3_writes_dropped_queue_full"] >= 64 - stats["l3_pending_writes"] - 1
    store.release()
    assert llm.flush_cache().storage.complete
    stats = llm.engine.metrics()
    assert stats["l3_pending_write_bytes"] == 0 and stats["l3_writes"] > written


def test_prefetch_rows_are_reserved_while_in_flight(make_llm):
    # Host pools of 8192 rows per kind: 0.2% is 32 rows, room for one 16-page prefetch
    # (16 full-attention rows + a 32-token window of sliding-window rows), not two.
    llm = make_llm(hicache_host_rate_limit=0.002)
    a, b = prompt(seed=81), prompt(seed=82)
    refs = [run(llm, a), run(llm, b)]
    assert llm.flush_cache().success
    prefetch = llm.engine.scheduler.prefetch
    store = faulty(llm)
    store.hang("get")  # a's reads stay in flight
    rid_a = llm.engine.add_request(input_ids=a, sampling_params=SAMPLING, return_logprob=True)
    held = prefetch.metrics()["prefetch_host_rows_in_flight"]
    assert 16 < held == prefetch.prefetched_rows() <= 32  # counted before a single row arrived
    rid_b = llm.engine.add_request(input_ids=b, sampling_params=SAMPLING, return_logprob=True)
    assert prefetch.metrics()["prefetch_refused_host_full"] == 1 and prefetch.prefetched_rows() == held
    store.release()
    out_a, out_b = _finish(llm, [rid_a, rid_b])
    assert out_a["meta_info"]["cached_tokens_details"]["storage"] > 0
    assert out_b["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert_same_as_recompute(out_a, refs[0])
    assert_same_as_recompute(out_b, refs[1])
    # Applied and used by its request: nothing is held for prefetches any more.
    assert prefetch.prefetched_rows() == 0 and prefetch.metrics()["prefetch_host_rows_in_flight"] == 0
