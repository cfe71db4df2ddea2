"""Bounded L3: the recency index against a plain LRU, the lease, and eviction by a cap, a
free-space floor and past pages that cannot be removed."""

import collections
import os
import random

import numpy as np
import pytest

from hicache_jax.storage.capacity import INDEX, CapacityConfig
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.journal import JOURNAL, encode_records
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import PAGES, page_path
from hicache_jax.storage.lease import Lease
from hicache_jax.storage.lru_index import LruIndex
from hicache_jax.storage.tensorstore_store import TensorStoreL3

NS = Namespace("tiny", "float32", 4, 1)
PAGE = 1024  # float32 elements per page array: ~4 KiB values


def chain(seed: int, n: int) -> list[str]:
    tokens = np.random.default_rng(seed).integers(0, 1000, 4 * n)
    return [page_path(NS, h, "kv") for h in page_hashes(tokens, 4, NS)]


def pages(seed: int, n: int):
    return [(k, {"x": np.full(PAGE, seed * 1000 + j, np.float32)}) for j, k in enumerate(chain(seed, n))]


def stored_bytes(store) -> int:
    keys = store.list_keys(PAGES)
    return sum(len(v) for v in store.get(keys) if v is not None)


def test_index_evicts_like_a_plain_lru():
    """Random writes and re-reads in journal segments; the index's victims are exactly the
    least recently used pages of a reference OrderedDict LRU."""
    rng = random.Random(0)
    keys = [k for s in range(30) for k in chain(s, 3)]
    ref: collections.OrderedDict[str, int] = collections.OrderedDict()
    idx = LruIndex()
    for t in range(40):
        batch = rng.sample(keys, 7)
        sizes = {k: rng.randint(1, 9) for k in batch}
        idx.fold(encode_records(float(t), [(k, sizes[k]) for k in batch]))
        for k in batch:  # within a segment the later-recorded page is the newer
            ref.pop(k, None)
            ref[k] = sizes[k]
    assert idx.pages == len(ref) and idx.total_bytes == sum(ref.values())
    want = 0.4 * idx.total_bytes
    order, acc = [], 0
    for k, size in ref.items():
        if acc >= want:
            break
        order.append(k)
        acc += size
    got = idx.paths(idx.victims(int(want)))
    assert got == order


def test_index_checkpoint_round_trips():
    idx = LruIndex()
    idx.fold(encode_records(5.0, [(k, 10) for k in chain(1, 4)]))
    back, folded = LruIndex.decode(idx.encode(["j1", "j2"]))
    assert folded == ["j1", "j2"] and back.pages == 4 and back.total_bytes == 40
    assert back.paths(back.victims(25)) == idx.paths(idx.victims(25))


def test_lease_one_holder_until_expiry_or_release():
    store = TensorStoreL3("memory://")
    now = [100.0]
    a, b = (Lease(store.read_generation, store.write_if, o, 10.0, lambda: now[0]) for o in "ab")
    assert a.acquire() and not b.acquire() and a.acquire()  # a renews; b is refused
    now[0] += 11  # a stopped renewing: its lease expired
    assert b.acquire() and not a.acquire() and not a.held()
    b.release()
    assert a.acquire()


def test_lease_race_has_one_winner():
    """Both read a free lease, then both write: the conditional write lets one through."""
    store = TensorStoreL3("memory://")
    a, b = (Lease(store.read_generation, store.write_if, o, 10.0) for o in "ab")
    _, gen = store.read_generation("meta/lease")
    real_read = store.read_generation
    stale = lambda key: (None, gen)  # noqa: E731 - both saw the lease free
    a._read = b._read = stale
    assert [a.acquire(), b.acquire()] == [True, False]
    assert real_read("meta/lease")[0] is not None


def _client(spec, **cap):
    cfg = CapacityConfig(**({"tick_s": 60.0, "lease_ttl_s": 600.0} | cap))
    return StorageClient(TensorStoreL3(spec), NS, capacity=cfg)


def test_cap_evicts_least_recently_used_down_to_the_low_watermark(tmp_path):
    c = _client(str(tmp_path), max_bytes=40 * 4200, low_watermark=0.5)
    for s in range(12):  # 12 chains x 4 pages of ~4.3 KB: past the cap after 9
        c.write_async(pages(s, 4))
        assert c.flush(10)
        if s == 7:
            assert len(c.prefetch(chain(0, 4)).result(10)) == 4  # chain 0 read again: recent
        c.capacity.tick()
    st = c.stats()
    assert st["evicted_pages"] > 0 and stored_bytes(c.store) <= 40 * 4200
    assert c.match_prefix(chain(0, 4)) == 4  # kept: read after chains 1..7 were written
    assert c.match_prefix(chain(1, 4)) == 0  # the least recently used chain went first
    assert c.match_prefix(chain(11, 4)) == 4
    c.close()
    idx, _ = LruIndex.decode(TensorStoreL3(str(tmp_path)).get([INDEX])[0])
    assert idx.total_bytes == stored_bytes(TensorStoreL3(str(tmp_path)))  # checkpoint == store


def test_unremovable_page_is_skipped_and_does_not_stall_eviction(tmp_path):
    c = _client(str(tmp_path), max_bytes=10 * 4200, low_watermark=0.5)
    c.write_async(pages(0, 4))
    assert c.flush(10)
    c.capacity.tick()
    victim = os.path.join(str(tmp_path), chain(0, 4)[3])  # the first page eviction picks
    os.remove(victim)
    if os.geteuid() == 0:  # root ignores permissions: a non-empty directory cannot go either
        os.makedirs(os.path.join(victim, "x"))
    else:
        open(victim, "wb").close()
        os.chmod(os.path.dirname(victim), 0o555)
    try:
        for s in range(1, 6):
            c.write_async(pages(s, 4))
            assert c.flush(10)
            c.capacity.tick()
        st = c.stats()
        assert st["evict_skipped_unremovable"] == 1 and st["evicted_pages"] >= 10
        assert c.capacity.index.total_bytes <= 10 * 4200
        assert c.match_prefix(chain(5, 4)) == 4  # newest pages still written and kept
    finally:
        os.chmod(os.path.dirname(victim), 0o755)
        c.close()


def test_free_space_floor_triggers_eviction(tmp_path):
    floor = 10 * 4200
    c = _client(str(tmp_path), min_free_bytes=floor, low_watermark=0.9)
    # A disk with 20 KB free whatever L3 writes, plus what eviction gives back.
    c.capacity.free_bytes = lambda: 20_000 + c.capacity.counters["evicted_bytes"]
    for s in range(4):
        c.write_async(pages(s, 4))
        assert c.flush(10)
    c.capacity.tick()
    freed = c.stats()["evicted_bytes"]
    assert 20_000 + freed >= floor / 0.9 and freed < floor / 0.9 - 20_000 + 4300  # just enough
    assert c.match_prefix(chain(3, 4)) == 4 and c.match_prefix(chain(0, 4)) == 0
    c.capacity.free_bytes = lambda: 10**12  # plenty: nothing more goes
    c.capacity.tick()
    assert c.stats()["evicted_bytes"] == freed
    c.close()


def test_journal_is_folded_and_removed_after_a_checkpoint(tmp_path):
    c = _client(str(tmp_path), max_bytes=10**9)
    c.write_async(pages(0, 3))
    assert c.flush(10)
    c.capacity.tick()
    assert c.store.list_keys(JOURNAL) != []  # folded, not yet checkpointed
    c.close()  # final tick: checkpoint, journal deleted, lease released
    store = TensorStoreL3(str(tmp_path))
    assert store.list_keys(JOURNAL) == [] and store.read_generation("meta/lease")[0] is None


@pytest.mark.parametrize("bad", [dict(low_watermark=0), dict(max_bytes=-1), dict(lease_ttl_s=1, tick_s=1)])
def test_bad_capacity_config(bad):
    with pytest.raises(ValueError):
        CapacityConfig(**bad)


@pytest.mark.parametrize("all_namespaces", [False, True])
def test_cleared_store_starts_a_fresh_index(tmp_path, all_namespaces):
    c = _client(str(tmp_path), max_bytes=10**9)
    c.write_async(pages(0, 4))
    assert c.flush(10)
    c.capacity.tick()
    assert c.capacity.index.pages == 4
    # The admin route: this namespace's rows leave the index; or every page and the records go.
    c.clear(all_namespaces=all_namespaces)
    c.write_async(pages(1, 2))
    assert c.flush(10)
    c.capacity.tick()
    assert c.capacity.index.pages == 2 and c.health()["capacity_used_bytes"] == stored_bytes(c.store)
    assert c.stats().undeclared() == c.health().undeclared() == []  # /metrics knows every kind
    c.close()
