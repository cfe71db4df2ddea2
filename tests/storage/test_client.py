"""StorageClient: ordered prefetch with longest-good-prefix hits, write-behind, counters."""

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from hicache_jax.storage.base import L3Store
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.codec import encode_page
from hicache_jax.storage.keys import Namespace, page_hashes, page_keys, parse_key
from hicache_jax.storage.layout import page_path
from hicache_jax.storage.tensorstore_store import TensorStoreL3

NS = Namespace("tiny", "bfloat16", 4, 1)


def _pages(n, start=0):
    keys = page_keys(page_hashes(np.arange(4 * (start + n)), 4, NS), "kv")[start:]
    return [
        (
            k,
            {
                "k": np.full((2, 4, 8), i + start, ml_dtypes.bfloat16),
                "v": np.full((2, 4, 8), -(i + start), ml_dtypes.bfloat16),
            },
        )
        for i, k in enumerate(keys)
    ]


@pytest.fixture(params=["memory", "file"])
def client(request, tmp_path):
    spec = "memory://" if request.param == "memory" else str(tmp_path / "l3")
    c = StorageClient(TensorStoreL3(spec), NS, batch_size=3)
    yield c
    c.close()


def _eventually(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _ids(pages):
    return [int(p["k"][0, 0, 0]) for p in pages]


def test_write_then_prefetch_in_order(client):
    items = _pages(8)
    fut = client.write_async(items)
    assert client.flush(timeout=10)
    assert fut.result(timeout=1) == 8
    handle = client.prefetch([k for k, _ in items])  # 3 batches of <= 3 keys
    pages = handle.result(timeout=10)
    assert _ids(pages) == list(range(8)) and _ids(handle) == list(range(8))
    np.testing.assert_array_equal(pages[5]["v"], items[5][1]["v"])
    stats = client.stats()
    assert stats["reads"] == 8 and stats["writes"] == 8 and stats["pending_writes"] == 0
    assert client.match_prefix([k for k, _ in items]) == 8


def test_hit_is_longest_good_prefix(client):
    items = _pages(6)
    client.write_async(items[:2] + items[3:])  # page 2 missing
    client.flush()
    handle = client.prefetch([k for k, _ in items])
    assert _ids(handle.result(timeout=10)) == [0, 1]
    assert client.stats()["read_misses"] == 1
    assert client.match_prefix([k for k, _ in items]) == 2


def test_corrupt_page_is_a_miss_and_is_repaired(client):
    items = _pages(4)
    client.write_async(items)
    client.flush()
    bad_key = items[1][0]
    blob = bytearray(client.store.get([bad_key])[0])
    blob[-1] ^= 0xFF
    client.store.put([(bad_key, bytes(blob))], force=True)
    assert _ids(client.prefetch([k for k, _ in items]).result(timeout=10)) == [0]
    assert client.stats()["checksum_failures"] == 1
    # Deleted (after the prefetch answered) so that a rewrite repairs it.
    assert _eventually(lambda: client.store.exists([bad_key]) == [False])
    client.write_async(items)
    client.flush()
    assert len(client.prefetch([k for k, _ in items]).result(timeout=10)) == 4


def test_page_of_another_namespace_or_key_is_a_miss(client):
    items = _pages(2)
    other = Namespace("other-model", "bfloat16", 4, 1)
    # Same key, written by a client of another namespace (as a bug would): not used.
    client.store.put([(items[0][0], encode_page(items[0][1], other.fingerprint, items[0][0]))])
    # A valid page of this namespace stored under the wrong key: not used either.
    client.store.put([(items[1][0], encode_page(items[1][1], NS.fingerprint, items[0][0]))])
    assert client.prefetch([items[0][0]]).result(timeout=10) == []
    assert client.prefetch([items[1][0]]).result(timeout=10) == []
    stats = client.stats()
    assert stats["checksum_failures"] == 2 and stats["corrupt_namespace"] == stats["corrupt_key"] == 1
    assert client.store.exists([k for k, _ in items]) == [True, True]  # a reader does not delete them
    # ... but neither is a valid page for its key: this client's next backup overwrites both.
    assert client.write_async(items).result(timeout=10) == 2
    assert len(client.prefetch([k for k, _ in items]).result(timeout=10)) == 2


def test_salted_namespace_per_call(client):
    salted = NS.with_salt("tenant")
    items = _pages(2)
    client.write_async(items, namespace=salted)
    client.flush()
    assert client.prefetch([k for k, _ in items]).result(timeout=10) == []
    assert len(client.prefetch([k for k, _ in items], namespace=salted).result(timeout=10)) == 2


def test_write_async_dedupes_queued_and_stored(client):
    items = _pages(5)
    f1 = client.write_async(items)
    f2 = client.write_async(items[:3])  # all queued or already stored by now
    client.flush()
    assert f1.result(timeout=1) == 5 and f2.result(timeout=1) == 0
    assert client.write_async(items).result(timeout=1) == 0
    stats = client.stats()
    assert stats["writes"] == 5 and stats["skipped_writes"] == 8


def test_empty_prefetch_and_write():
    with StorageClient(TensorStoreL3("memory://"), NS) as c:
        assert c.prefetch([]).result(timeout=1) == []
        assert c.write_async([]).result(timeout=1) == 0
        assert c.match_prefix([]) == 0


class _SlowStore(L3Store):
    """A memory store whose writes wait for a gate and whose reads can fail."""

    def __init__(self):
        self.inner = TensorStoreL3("memory://")
        self.gate = threading.Event()
        self.fail_reads = False

    def exists(self, keys):
        return self.inner.exists(keys)

    def get(self, keys):
        if self.fail_reads:
            raise OSError("disk on fire")
        return self.inner.get(keys)

    def put(self, items, *, force=False):
        self.gate.wait(10)
        return self.inner.put(items, force=force)

    def delete(self, keys):
        self.inner.delete(keys)

    def clear(self, scope="", deadline=None):
        return self.inner.clear(scope, deadline)

    def close(self):
        self.inner.close()

    def stats(self):
        return self.inner.stats()


def test_write_async_never_blocks_and_flush_waits():
    store = _SlowStore()
    with StorageClient(store, NS) as c:
        fut = c.write_async(_pages(4))  # returns although the store is stuck
        assert not fut.done() and c.stats()["pending_writes"] == 4
        assert c.flush(timeout=0.05) is False
        store.gate.set()
        assert c.flush(timeout=10) and fut.result(timeout=1) == 4
        assert c.stats()["pending_writes"] == 0


def test_read_error_is_a_miss():
    store = _SlowStore()
    store.gate.set()
    with StorageClient(store, NS) as c:
        items = _pages(2)
        c.write_async(items)
        c.flush()
        store.fail_reads = True
        assert c.prefetch([k for k, _ in items]).result(timeout=10) == []
        assert c.stats()["read_errors"] == 1


def test_bad_page_fails_only_its_write_future():
    with StorageClient(TensorStoreL3("memory://"), NS) as c:
        good = c.write_async(_pages(1))
        bad = c.write_async([("f" * 64 + ".kv", {"x": np.zeros(2, np.complex64)})])
        c.flush()
        assert good.result(timeout=1) == 1
        with pytest.raises(ValueError, match="dtype"):
            bad.result(timeout=1)
        assert c.stats()["write_errors"] == 1


def test_close_flushes_pending_writes(tmp_path):
    c = StorageClient(TensorStoreL3(str(tmp_path)), NS)
    items = _pages(3)
    c.write_async(items)
    c.close()
    c.close()
    assert TensorStoreL3(str(tmp_path)).exists([k for k, _ in items]) == [True] * 3
    with pytest.raises(RuntimeError, match="closed"):
        c.write_async(items)


def test_clear_forgets_stored_keys(client):
    items = [
        (page_path(NS, parse_key(k)[0], "kv"), arrays) for k, arrays in _pages(2)
    ]  # as the tier keys them
    client.write_async(items)
    client.flush()
    client.clear()
    assert client.match_prefix([k for k, _ in items]) == 0
    assert client.write_async(items).result(timeout=10) == 2  # rewritten, not deduped


def test_cancel_stops_after_current_batch(client):
    items = _pages(9)
    client.write_async(items)
    client.flush()
    handle = client.prefetch([k for k, _ in items])
    handle.cancel()
    pages = handle.result(timeout=10)
    assert len(pages) in (0, 3, 6, 9) and _ids(pages) == list(range(len(pages)))


def test_write_queue_is_bounded_in_bytes():
    store = _SlowStore()  # puts wait for the gate: nothing leaves the queue
    page_bytes = 2 * (2 * 4 * 8 * 2)  # k and v, bfloat16
    with StorageClient(store, NS, max_queue_bytes=3 * page_bytes, batch_size=1) as c:
        t0 = time.monotonic()
        futures = [c.write_async([item]) for item in _pages(10)]
        assert time.monotonic() - t0 < 0.5  # never blocks
        stats = c.stats()
        assert stats["pending_writes"] == 3 and stats["pending_write_bytes"] == 3 * page_bytes
        assert stats["writes_dropped_queue_full"] == 7
        assert [f.result(timeout=1) for f in futures[3:]] == [0] * 7  # skipped, not failed
        store.gate.set()
        assert c.flush(timeout=10) and sum(f.result(timeout=1) for f in futures) == 3
        assert c.stats()["pending_write_bytes"] == 0
        assert c.write_async(_pages(10)[5:6]).result(timeout=5) == 1  # room again
