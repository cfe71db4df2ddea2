"""Random fault schedules over a sequence of L3 writes, reads and probes (hypothesis):
never a wrong page served, the client's bookkeeping stays consistent, and once the store
heals the chain is stored and served whole again."""

from __future__ import annotations

import errno
import time

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.storage.breaker import BreakerConfig
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.codec import CorruptPage
from hicache_jax.storage.faults import FaultyStore, flip_bit, restamp, truncate
from hicache_jax.storage.guard import L3Unavailable
from hicache_jax.storage.keys import Namespace, page_hashes, page_keys
from hicache_jax.storage.tensorstore_store import TensorStoreL3

NS = Namespace("schedule", "float32", 4, 1)
OTHER = Namespace("another-model", "float32", 4, 1)
N = 6
KEYS = page_keys(page_hashes(np.arange(4 * N), 4, NS), "kv")
PAGES = [{"kv": np.full((2, 4), 10.0 * i + 1, np.float32), "pos": np.array([i], np.int32)} for i in range(N)]
BACKOFF = 0.02

page = st.integers(0, N - 1)
step = st.one_of(
    st.tuples(st.just("write"), st.lists(st.booleans(), min_size=N, max_size=N)),
    st.tuples(st.just("read")),
    st.tuples(st.just("probe")),
    st.tuples(st.sampled_from(["truncate", "flip", "vanish", "delete", "foreign"]), page),
    st.tuples(st.just("swap"), page, page),
    st.tuples(st.just("fail"), st.sampled_from(["exists", "get", "put", "delete"])),
    st.tuples(st.just("hang"), st.sampled_from(["get", "put"])),
    st.tuples(st.just("heal")),
)


def _check_read(client: StorageClient) -> int:
    got = client.prefetch(KEYS).result(timeout=10)
    for i, p in enumerate(got):  # a prefix of the chain, each page exactly what was written
        assert int(p["pos"][0]) == i
        np.testing.assert_array_equal(p["kv"], PAGES[i]["kv"])
    return len(got)


def _damage(store: FaultyStore, op: str, *pages: int) -> None:
    inner = store.inner
    values = inner.get([KEYS[i] for i in pages])
    if op == "vanish":
        store.vanish_after_probe(KEYS[pages[0]])
    elif op == "delete":
        inner.delete([KEYS[pages[0]]])
    elif values[0] is None:
        return
    elif op == "truncate":
        inner.put([(KEYS[pages[0]], truncate(values[0]))], force=True)
    elif op == "flip":
        inner.put([(KEYS[pages[0]], flip_bit(values[0]))], force=True)
    elif op == "foreign":
        try:
            v = restamp(values[0], NS.fingerprint, OTHER.fingerprint, KEYS[pages[0]])
        except CorruptPage:
            return  # already damaged: nothing whole to restamp
        inner.put([(KEYS[pages[0]], v)], force=True)
    elif op == "swap" and values[1] is not None:
        inner.put([(KEYS[pages[0]], values[1]), (KEYS[pages[1]], values[0])], force=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=12))
def test_random_fault_schedule(schedule):
    store = FaultyStore(TensorStoreL3("memory://"))
    breaker = BreakerConfig(threshold=2, backoff_s=BACKOFF, max_backoff_s=BACKOFF)
    client = StorageClient(store, NS, timeout_s=0.03, batch_size=4, breaker=breaker)
    try:
        for op, *args in schedule:
            if op == "write":
                client.write_async([(KEYS[i], PAGES[i]) for i in range(N) if args[0][i]])
                client.drain(2.0)
            elif op == "read":
                _check_read(client)
            elif op == "probe":
                try:
                    present = client.exists(KEYS)
                except (L3Unavailable, TimeoutError, OSError):
                    continue
                for key, there in zip(KEYS, present):
                    assert there or not client.is_known_stored(key)  # gone means forgotten
            elif op == "fail":
                store.fail(lambda: OSError(errno.EIO, "I/O error"), args[0])
            elif op == "hang":
                store.hang(args[0])
            elif op == "heal":
                store.heal()
            else:
                _damage(store, op, *args)
            stats = client.stats()
            assert stats["pending_write_bytes"] >= 0 and client.health()["stuck_calls"] <= 8

        # Healed, the store fills again: each round repairs at least the first bad page.
        store.heal()
        for _ in range(N + 2):
            time.sleep(2 * BACKOFF)  # let an open breaker probe again
            client.write_async(list(zip(KEYS, PAGES)))
            assert client.drain(5.0).complete
            if _check_read(client) == N:
                break
        assert _check_read(client) == N
        stats = client.stats()
        assert stats["pending_writes"] == stats["pending_write_bytes"] == 0
    finally:
        store.heal()
        client.close()
