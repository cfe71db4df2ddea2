"""The eviction queues choose what a full scan of the trees would.

Two caches take the same random operations: the real one, and one whose victims are
chosen by scanning every node (the least recently used evictable node, deeper first among
nodes touched together; a full page without a host copy only once nothing on the device
hangs below it). Every operation must leave both with the same trees, indices included,
and the real one's queues, counters and pools consistent (``check_integrity``)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.cache.eviction_order import EvictionOrder
from hicache_jax.cache.holdings import Holdings
from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.cache.radix import Node
from tests.cache_rules import classic_rules

P = 2
WINDOW = 3


class FakeTransfer:
    def read(self, kind, idx):
        return {"x": np.asarray(idx, np.float32)[:, None]}

    def write(self, kind, idx, arrays):
        pass


def _device_below(node: Node) -> bool:
    stack = list(node.children.values())
    while stack:
        x = stack.pop()
        if x.on_device:
            return True
        stack.extend(x.children.values())
    return False


class ScanOrder(EvictionOrder):
    """Chooses victims by scanning everything (the definition, not the data structure)."""

    def __init__(self, held: Holdings, write_back: bool):
        super().__init__(held.pools, held.host, write_back)
        self.held = held

    def victim(self, kind):
        # The same rule, with "a device page below" found by a scan, not the kept count.
        cands = [x for x in self.held.nodes() if self.may_evict(x, kind, device_below=_device_below)]
        return min(cands, key=lambda x: (x.last_access, -x.depth), default=None)

    def host_victim(self, kind):
        cands = []
        for x in self.held.nodes():
            if kind not in x.host:
                continue
            only = kind not in x.dev
            if only and kind == "full" and (x.children or x.lock_ref):
                continue
            cands.append(x)
        return min(cands, key=lambda x: (kind not in x.dev, x.last_access, -x.depth), default=None)


def make(scan: bool, kinds, policy):
    rules = classic_rules(P, window=WINDOW if "swa" in kinds else None, state="state" in kinds)
    sizes = {"full": 7, "swa": 5, "state": 5}
    pools = {k: IndexPool(sizes[k], k) for k in kinds}
    host = {k: HostPool(k, 6, {"x": ((1,), np.float32)}) for k in kinds}
    cache = PrefixCache(rules, pools, host=host, transfer=FakeTransfer(), write_policy=policy)
    if scan:  # still empty: the scanning order takes over from the start
        cache.held.order = ScanOrder(cache.held, write_back=policy == "write_back")
    return cache


def tokens(seq: int, n_pages: int) -> list[int]:
    """Sequence ``seq``'s page j is (bit j of seq, j): sequences share prefixes."""
    return [t for j in range(n_pages) for t in ((seq >> j) & 1, j)] + [99]


def state(c: PrefixCache) -> list:
    out = []
    for salt, tree in c.trees.items():
        for n in tree.nodes():
            path, x = [], n
            while not x.is_root:
                path.append(x.key)
                x = x.parent
            data = (sorted(n.dev.items()), sorted(n.host.items()), n.lock_ref, n.window_lock)
            out.append((str(salt), tuple(path[::-1]), data))
    pools = [p.num_free for p in c.pools.values()] + [h.index.num_free for h in c.host.values()]
    return sorted(out) + [pools, c.storage_rows]


def insert(c: PrefixCache, toks: list[int], start: Node | None, n: int, salt: str | None):
    """Insert pages ``start.depth .. n-1`` with fresh device pages, as a request would."""
    first = start.depth if start else 0
    got = {}
    for kind in c.pools:
        got[kind] = c.alloc(kind, n - first)
        if got[kind] is None:
            for k, idx in got.items():
                if idx:
                    c.pools[k].free(idx)
            return None, "no room"
    pages = {k: [None] * first + idx for k, idx in got.items()}
    node, taken = c.insert(toks, start, n, pages, salt=salt)
    for kind, idx in pages.items():
        c.pools[kind].free([p for j, p in enumerate(idx) if p is not None and j not in taken[kind]])
    return node, sorted((k, sorted(v)) for k, v in taken.items())


def apply(c: PrefixCache, op: tuple, held: list) -> object:
    """One operation; ``held`` lists what running "requests" lock: (node, swa-locked
    nodes, sequence, salt)."""
    name, a, b = op
    seq, n = a % 8, b % 4 + 1
    salt = "t" if a >= 8 else None
    toks = tokens(seq, n)
    if name == "insert":
        return insert(c, toks, None, n, salt)[1]
    if name == "admit":
        m = c.match(toks, len(toks), salt=salt)
        c.lock(m.last)
        window = m.nodes[-2:] if "swa" in c.pools else []
        c.window_lock(window)
        ok = c.load(m) if m.loads else True
        if not ok:
            c.window_unlock(window)
            c.unlock(m.last)
        else:
            held.append((m.last, window, seq, salt))
        return m.end, ok
    if name == "extend" and held:  # a running request adds pages below what it locks
        i = a % len(held)
        last, window, seq, salt = held[i]
        depth = last.depth if last else 0
        node, taken = insert(c, tokens(seq, 4), last, min(4, depth + b % 2 + 1), salt)
        if node is not None:
            c.relock(last, node)
            if "swa" in c.pools and node is not last:
                c.window_lock([node])
                window = window + [node]
            held[i] = (node, window, seq, salt)
        return taken
    if name == "release" and held:
        last, window, _, _ = held.pop(a % len(held))
        c.window_unlock(window)
        c.unlock(last)
    elif name == "insert_host":
        rows = {j: {k: {"x": np.zeros((1,), np.float32)} for k in c.host} for j in range(n)}
        return c.insert_host(toks, salt, rows, [b"h"] * n, n)
    elif name == "backup":
        return c.backup_pending()
    elif name == "evict":
        return c.evict(list(c.pools)[b % len(c.pools)], a % 4 + 1)
    elif name == "evict_host":
        return c.evict_host(list(c.host)[b % len(c.host)], a % 4 + 1)
    elif name == "flush":
        c.flush()
    elif name == "drop_device" and not held:
        c.drop_device()
    return None


OPS = st.tuples(
    st.sampled_from(
        ["insert"] * 3
        + ["admit"] * 3
        + ["extend"] * 3
        + ["release"] * 2
        + ["insert_host", "backup", "evict", "evict", "evict_host", "flush", "drop_device"]
    ),
    st.integers(0, 15),
    st.integers(0, 7),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.sampled_from([("full",), ("full", "swa"), ("full", "state")]),
    policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    ops=st.lists(OPS, min_size=30, max_size=80),
)
def test_queues_evict_what_a_full_scan_would(kinds, policy, ops):
    real, ref = make(False, kinds, policy), make(True, kinds, policy)
    held_real, held_ref = [], []
    for op in ops:
        assert apply(real, op, held_real) == apply(ref, op, held_ref), op
        assert state(real) == state(ref), op
        real.check_integrity()
    for last, window, _, _ in held_real:
        real.window_unlock(window)
        real.unlock(last)
    real.flush()
    real.check_integrity()
    assert not real.trees and all(p.num_free == p.size for p in real.pools.values())
