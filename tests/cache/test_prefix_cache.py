"""The L1 prefix cache: LRU eviction, locks, SWA tombstones, integrity checks."""

import numpy as np
import pytest

from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix_cache import PrefixCache
from tests.cache_rules import classic_rules

P = 4


def make(window=None, pages=16):
    rules = classic_rules(P, window=window)
    pools = {"full": IndexPool(pages, "full")}
    if window:
        pools["swa"] = IndexPool(pages, "swa")
    return PrefixCache(rules, pools)


def put(cache, tokens, n_pages):
    pages = {k: pool.alloc(n_pages) for k, pool in cache.pools.items()}
    node, taken = cache.insert(tokens, None, n_pages, pages)
    for kind, idx in pages.items():  # what the tree did not take stays ours: free it
        cache.pools[kind].free([p for j, p in enumerate(idx) if j not in taken[kind]])
    return node


def test_match_and_duplicate_insert():
    c = make()
    seq = list(range(100, 113))  # 3 full pages + 1 token
    put(c, seq, 3)
    assert c.match(seq, len(seq)).end == 12
    assert c.match(seq[:9], 9).end == 8
    assert c.match([1] + seq[1:], 13).end == 0
    put(c, seq, 3)  # the same pages again: nothing new is taken
    assert c.pools["full"].num_used == 3
    c.check_integrity()


def test_lru_eviction_spares_locked_nodes():
    c = make(pages=6)
    a, b = list(range(0, 12)), list(range(50, 62))
    node_a = put(c, a, 3)
    put(c, b, 3)
    c.lock(node_a)
    mine = c.alloc("full", 3)  # only b's pages can go
    assert mine is not None and len(mine) == 3
    assert c.match(a, 13).end == 12 and c.match(b, 13).end == 0
    assert c.alloc("full", 1) is None  # a is locked
    c.unlock(node_a)
    more = c.alloc("full", 1)
    assert more is not None
    c.check_integrity(held_outside={"full": mine + more})  # what this test holds, counted by itself
    with pytest.raises(AssertionError, match="leaked"):
        c.check_integrity(held_outside={"full": mine})


def test_swa_tombstones_block_ends_but_not_passage():
    c = make(window=5)  # the token at e reads e-4..e-1
    seq = list(range(24))
    put(c, seq, 6)
    assert c.match(seq, 24).end == 20
    path = c.tree().walk(seq, 6)

    def tombstone(j):  # page j holds tokens 4j..4j+3
        c.pools["swa"].free([path[j].dev["swa"]])
        c.held.set_device(path[j], "swa", None)

    tombstone(3)
    assert c.match(seq, 24).end == 20  # end 20 reads 16..19 (page 4): passes page 3
    tombstone(4)
    assert c.match(seq, 24).end == 12  # 20 reads page 4, 16 reads page 3; 12 reads page 2
    c.check_integrity()


def test_integrity_catches_leaks_and_double_owners():
    c = make()
    put(c, list(range(8)), 2)
    leaked = c.pools["full"].alloc(1)
    with pytest.raises(AssertionError, match="leaked"):
        c.check_integrity()
    c.check_integrity(held_outside={"full": leaked})
    owned = c.tree_indices()["full"][:1]
    with pytest.raises(AssertionError, match="owned twice"):
        c.check_integrity(held_outside={"full": leaked + owned})


def test_pool_refuses_double_free():
    pool = IndexPool(4, "p")
    got = pool.alloc(2)
    pool.free(got)
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.free(got[:1])
    assert pool.alloc(5) is None and pool.num_free == 4


def test_a_page_without_host_copy_goes_with_its_host_only_subtree():
    """L1 can end in a prefix whose deeper pages live only in L2: A (device only) -> B (host
    only) -> C (device and host). Evicting C must make A evictable in the same call, and A
    goes with B (which nothing could match without A)."""
    from hicache_jax.cache.host_pool import HostPool

    rules = classic_rules(P)
    host = {"full": HostPool("full", 8, {"kv": ((1,), np.float32)})}
    c = PrefixCache(rules, {"full": IndexPool(3, "full")}, host=host, write_policy="write_through")
    seq = list(range(12))
    pages = {"full": c.pools["full"].alloc(3)}
    c.insert(seq, None, 3, pages)
    a, b, cc = c.tree().walk(seq, 3)
    for node in (b, cc):  # B and C have host copies; A has none (its backup was skipped)
        c.held.set_host(node, "full", host["full"].index.alloc(1)[0])
    c.pools["full"].free([b.dev["full"]])
    c.held.set_device(b, "full", None)  # B lives on the host only
    assert c.evict("full", 2) == 2  # C's device page, then A with B
    assert c.pools["full"].num_free == 3 and c.tree().walk(seq, 3) == []
    c.check_integrity()


def test_nodes_passed_over_while_pinned_are_evictable_once_free():
    """A node the eviction queue meets while it cannot go (a device page below a page
    without host copy; a sliding-window lock) is evicted later, once it can."""
    from hicache_jax.cache.host_pool import HostPool

    rules = classic_rules(P, window=5)
    host = {"full": HostPool("full", 4, {"kv": ((1,), np.float32)})}
    pools = {"full": IndexPool(4, "full"), "swa": IndexPool(4, "swa")}
    c = PrefixCache(rules, pools, host=host, write_policy="write_through_selective")
    seq = list(range(12))
    a = put(c, seq, 1)  # A first: older than B, and no host copy
    idx = {k: [None] + p.alloc(1) for k, p in pools.items()}
    b, _ = c.insert(seq, a, 2, idx)
    c.held.set_host(b, "full", host["full"].index.alloc(1)[0])
    assert c.evict("full", 1) == 1 and "full" not in b.dev and "full" in a.dev  # A waited for B
    assert c.evict("full", 1) == 1 and c.tree().walk(seq, 2) == []  # then A went, with B
    c.check_integrity()

    x, y = put(c, seq, 1), put(c, list(range(50, 54)), 1)  # X older than Y
    c.window_lock([x])
    assert c.evict("swa", 1) == 1 and "swa" not in y.dev and "swa" in x.dev
    c.window_unlock([x])
    c.check_integrity()
    assert c.evict("swa", 1) == 1 and "swa" not in x.dev
    c.check_integrity()
