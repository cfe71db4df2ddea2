"""Bounded time on every L3 call: a store that hangs never blocks an engine step, flush_cache
and close answer within their deadline, and slow L3 is bounded by the timeout policy."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np

from hicache_jax.scheduler.l3_prefetch import prefetch_timeout
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.faults import FaultyStore
from hicache_jax.storage.keys import Namespace, page_hashes, page_keys
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.cache.l3_helpers import P, assert_same_as_recompute, prompt, run
from tests.reliability.conftest import faulty

NS = Namespace("tiny", "bfloat16", 4, 1)
MARGIN = 1.5  # seconds of compute and scheduling on a busy 2-core machine


def _pages(n, seed=0):
    keys = page_keys(page_hashes(np.arange(seed, seed + 4 * n), 4, NS), "kv")
    return [(k, {"k": np.full((2, 4, 8), i, ml_dtypes.bfloat16)}) for i, k in enumerate(keys)]


def _l3_threads() -> int:
    return sum(t.name.startswith("l3-") for t in threading.enumerate())


def test_hung_store_client_never_blocks_and_its_waits_are_bounded():
    before = _l3_threads()  # other tests' engines may still hold L3 threads in this process
    store = FaultyStore(TensorStoreL3("memory://"))
    client = StorageClient(store, NS, timeout_s=0.2, max_store_calls=3, batch_size=4)
    store.hang()
    t0 = time.monotonic()
    futures = [client.write_async(_pages(4, seed=100 * i)) for i in range(10)]
    assert time.monotonic() - t0 < 0.1  # 40 pages queued without waiting on the store
    handle = client.prefetch([k for k, _ in _pages(8)])
    assert handle.result(timeout=2.0) == []  # one read deadline, then a miss
    # A few calls time out, then the breaker (or the live-call bound) refuses the rest at
    # once: the queue empties as skipped backups instead of waiting on a dead store.
    report = client.drain(2.0)
    assert report.complete and report.seconds < 1.0
    for _ in range(20):  # however many more calls are attempted...
        client.prefetch([k for k, _ in _pages(2, seed=7)]).result(timeout=2.0)
        client.write_async(_pages(1, seed=9))
    assert client.health()["stuck_calls"] <= 3 and store.blocked <= 3  # ... few are stuck
    assert _l3_threads() - before < 10
    assert client.drain(1.0).complete
    stats = client.stats()
    assert stats["timeouts"] >= 2 and stats["refused"] > 0 and stats["writes_dropped_unavailable"] > 0
    assert stats["pending_write_bytes"] == 0 and all(f.done() for f in futures)
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 0.2 + MARGIN
    store.release()


def test_slow_store_drain_and_close_stop_at_their_deadline():
    store = FaultyStore(TensorStoreL3("memory://"))
    client = StorageClient(store, NS, timeout_s=1.0, batch_size=4)
    store.slow(0.15, "put")  # each batch of 4 pages takes 0.15 s: 10 batches take 1.5 s
    futures = [client.write_async(_pages(4, seed=100 * i)) for i in range(10)]
    report = client.drain(0.3)
    assert 0.3 <= report.seconds < 0.3 + MARGIN and report.pending > 0 and report.written > 0
    t0 = time.monotonic()
    closed = client.close(timeout=0.2)
    assert time.monotonic() - t0 < 0.2 + MARGIN
    stats = client.stats()
    assert 0 < stats["writes_abandoned"] <= closed.pending + 4 and stats["writes"] >= 4
    deadline = time.monotonic() + 2.0
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.01)  # the batch being written when close returned settles on its own
    assert all(f.done() for f in futures) and client.stats()["pending_write_bytes"] == 0


def test_hung_l3_never_blocks_the_engine_and_flush_answers(make_llm):
    timeout = 0.5
    llm = make_llm(hicache_storage_timeout_s=timeout)
    ids = prompt(seed=61)
    ref = run(llm, ids)
    assert llm.flush_cache().success
    store = faulty(llm)
    store.hang()  # every call blocks until released: like a dead NFS mount
    for seed in (61, 62, 63, 64):
        t0 = time.monotonic()
        out = run(llm, prompt(seed=seed))
        # wait_complete waits for the prefetch, whose probe gives up after one deadline.
        assert time.monotonic() - t0 < timeout + MARGIN, seed
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
        if seed == 61:
            assert_same_as_recompute(out, ref)
    t0 = time.monotonic()
    result = llm.flush_cache()
    took = time.monotonic() - t0
    assert result.success and took < timeout + MARGIN, (took, result)
    report = result.to_dict()
    assert report["success"] and set(report["l3"]) >= {"writes_drained", "writes_pending", "complete"}
    stats = llm.engine.metrics()
    assert stats["l3_timeouts"] >= 1 and stats["storage_stuck_calls"] <= 8
    assert stats["prefetch_host_rows_in_flight"] == 0  # no reservation outlives its task
    t0 = time.monotonic()
    llm.close()
    assert time.monotonic() - t0 < timeout + MARGIN
    assert store.blocked <= 8  # ClientConfig.max_store_calls


def test_slow_l3_timeout_policy_bounds_ttft(make_llm):
    llm = make_llm(hicache_storage_timeout_s=30.0, hicache_storage_prefetch_policy="timeout")
    ids = prompt(seed=71)
    ref = run(llm, ids)
    assert llm.flush_cache().success
    faulty(llm).slow(4.0, "get")  # reads take longer than the policy waits
    out = run(llm, ids)
    ttft = out["meta_info"]["ttft"]
    limit = prefetch_timeout(len(ids))
    assert limit - 0.1 <= ttft <= limit + MARGIN, (ttft, limit)
    assert_same_as_recompute(out, ref)
    assert llm.engine.metrics()["prefetch_timed_out"] == 1
    assert out["meta_info"]["cached_tokens"] < len(ids) - P  # it did not wait for L3
