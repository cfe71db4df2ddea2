"""The prefix cache over device (L1) and, optionally, host (L2) memory, behind a
request-free API: one radix tree per ``cache_salt``, matching with tier accounting, L2 ->
L1 loads, inserts from L1 and from L3, locks, maintenance and integrity checks.

Two parts are modules of their own, reached only through this facade:

- ``eviction.py`` (``Eviction``): each pool's eviction rule, its LRU order and the victims;
- ``write_policy.py`` (``Backups``): when device data is copied to the host, the copies,
  and the ``on_backup`` hook that queues the L3 write.

Every change to a node's data goes through the setters below (``set_device``,
``set_host``, ``set_from_storage``, ``remove_leaf``, ``remove_subtree``, ``prune``), which
keep the eviction order, ``dev_kids`` and ``storage_rows`` current. Only maintenance
(flush, drop_device, check_integrity) walks everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from hicache_jax.cache import integrity
from hicache_jax.cache.eviction import Eviction
from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.cache.radix import Node, RadixTree
from hicache_jax.cache.write_policy import Backups
from hicache_jax.kinds import ALL as ALL_KINDS
from hicache_jax.kinds import CacheKind
from hicache_jax.metric_kinds import Metrics

KINDS = ALL_KINDS


@dataclasses.dataclass
class Match:
    nodes: list[Node]  # the reused path, root excluded
    end: int  # tokens: len(nodes) * page_size
    loads: list[tuple[str, Node]] = dataclasses.field(default_factory=list)  # host -> device
    tiers: dict = dataclasses.field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    page_tiers: list[str] = dataclasses.field(default_factory=list)  # each page's tier, in order

    @property
    def last(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None


class PrefixCache:
    def __init__(
        self,
        rules: PrefixRules,
        pools: dict[str, IndexPool],
        *,
        enabled: bool = True,
        host: dict[str, HostPool] | None = None,
        transfer=None,  # .read(kind, device_idx) -> arrays, .write(kind, device_idx, arrays)
        write_policy: str = "write_through",
    ):
        self.rules = rules
        self.pools = pools
        self.enabled = enabled
        self.host = host or {}
        self.transfer = transfer
        self.write_policy = write_policy
        self.trees: dict[str | None, RadixTree] = {}
        self.counters = Metrics().counters({"host_loads": 0, "host_backups": 0, "backup_skipped": 0})
        self.storage_rows = 0  # host rows of nodes L3 filled that no match used yet
        self.eviction = Eviction(self)
        self.backups = Backups(self, write_policy, self.counters)

    # ---- trees (one per cache_salt: tenants never share pages) ----------------------------
    def tree(self, salt: str | None = None) -> RadixTree:
        """The salt's tree, made on first insert. A tree that empties is dropped (see
        ``_unlink``), so a stream of one-off salts never accumulates trees."""
        if salt not in self.trees:
            self.trees[salt] = RadixTree(self.rules.page_size, salt)
        return self.trees[salt]

    def walk(self, tokens: Sequence[int], max_pages: int, salt: str | None = None) -> list[Node]:
        """The cached path along ``tokens`` (lookups never create a tree)."""
        tree = self.trees.get(salt)
        return tree.walk(tokens, max_pages) if tree is not None else []

    def salt_of(self, node: Node) -> str | None:
        return node.tree.salt

    def nodes(self) -> Iterator[Node]:
        for t in list(self.trees.values()):
            yield from t.nodes()

    # ---- lookup -------------------------------------------------------------------------
    def availability(self, path: Sequence[Node]) -> tuple[list[bool], list[bool], list[bool]]:
        """What each node of ``path`` holds in any tier: full, sliding-window, state snapshot."""
        return tuple([n.has(k) for n in path] for k in KINDS)

    def match(
        self, tokens: Sequence[int], input_len: int, logprob_start_len: int = -1, salt: str | None = None
    ) -> Match:
        """The longest usable prefix in any tier (``usable_prefix_end``), and the host ->
        device loads it needs."""
        if not self.enabled:
            return Match([], 0)
        P = self.rules.page_size
        path = self.walk(tokens, self.rules.max_end(input_len, logprob_start_len) // P, salt)
        end = usable_prefix_end(self.rules, input_len, logprob_start_len, *self.availability(path))
        nodes = path[: end // P]
        RadixTree.touch(nodes)
        match = Match(nodes, end)
        window = set(self.rules.swa_pages_needed(end)) if CacheKind.SWA in self.pools else set()
        page_tier = []
        for j, node in enumerate(nodes):
            need = [k for k in (CacheKind.FULL,) if k in self.pools]
            need += [CacheKind.SWA] if j in window else []
            need += [CacheKind.STATE] if CacheKind.STATE in self.pools and j == len(nodes) - 1 else []
            missing = [k for k in need if getattr(node, k) is None]
            match.loads += [(k, node) for k in missing]
            tier = (
                None if not need else "device" if not missing else "storage" if node.from_storage else "host"
            )
            page_tier.append(tier)
            node.hit_count += 1
            self.backups.hit(node)
        # Pages that need no data (before a sliding window) count with the hit's deepest tier.
        fallback = next((t for t in ("storage", "host") if t in page_tier), "device")
        match.page_tiers = [tier or fallback for tier in page_tier]
        for tier in match.page_tiers:
            match.tiers[tier] += P
        return match

    def load(self, match: Match) -> bool:
        """Bring the match's host-only data to the device (all or nothing). The caller has
        locked the path (and the window) so allocation cannot evict it."""
        by_kind: dict[str, list[Node]] = {}
        for kind, node in match.loads:
            by_kind.setdefault(kind, []).append(node)
        got: dict[str, list[int]] = {}
        for kind, nodes in by_kind.items():
            idx = self.alloc(kind, len(nodes))
            if idx is None:
                for k, i in got.items():
                    self.pools[k].free(i)
                return False
            got[kind] = idx
        for kind, nodes in by_kind.items():
            rows = [getattr(n, "host_" + kind) for n in nodes]
            self.transfer.write(kind, got[kind], self.host[kind].read(rows))
            for n, i in zip(nodes, got[kind]):
                self.set_device(n, kind, i)
            self.counters["host_loads"] += len(nodes)
        for n in match.nodes:
            self.set_from_storage(n, False)
        match.loads = []
        return True

    # ---- allocation with eviction, and host backups (eviction.py, write_policy.py) ---------
    def alloc(self, kind: str, n: int) -> list[int] | None:
        """``n`` device indices of ``kind``, evicting unlocked data for them; None: no room."""
        return self.eviction.alloc(kind, n)

    def host_alloc(self, kind: str, n: int) -> list[int] | None:
        """``n`` host rows of ``kind``, evicting host data for them; None: no room."""
        return self.eviction.host_alloc(kind, n)

    def evict(self, kind: str, n: int) -> int:
        """Free at least ``n`` device indices of ``kind`` if unlocked nodes allow."""
        return self.eviction.evict(kind, n)

    def evict_host(self, kind: str, n: int) -> int:
        """Free at least ``n`` host rows of ``kind`` if unlocked nodes allow."""
        return self.eviction.evict_host(kind, n)

    def backup_pending(self, everything: bool = False) -> int:
        """Copy what the write policy queued to the host (``everything``: a write-back flush)."""
        return self.backups.backup_pending(everything)

    @property
    def on_backup(self) -> Callable[[Node, tuple[str, ...]], None] | None:
        """Called with each node and the kinds a backup copied to the host."""
        return self.backups.on_backup

    @on_backup.setter
    def on_backup(self, hook: Callable[[Node, tuple[str, ...]], None] | None) -> None:
        self.backups.on_backup = hook

    # ---- every change to a node's data goes through these (they keep the eviction order) ---
    def set_device(self, node: Node, kind: str, idx: int | None) -> None:
        """Set a device index (None: gone)."""
        was = getattr(node, kind) is not None
        setattr(node, kind, idx)
        if kind == CacheKind.FULL and was != (idx is not None) and not node.dev_kids:
            self.eviction.device_page_changed(node.parent, 1 if idx is not None else -1)
        self.eviction.offer(node)

    def set_host(self, node: Node, kind: str, row: int | None) -> None:
        """Set a host row (None: gone)."""
        if node.from_storage:
            self.storage_rows += (row is not None) - (getattr(node, "host_" + kind) is not None)
        setattr(node, "host_" + kind, row)
        self.eviction.offer(node)

    def set_from_storage(self, node: Node, value: bool) -> None:
        if node.from_storage != value:
            held = sum(getattr(node, "host_" + k) is not None for k in self.host)
            self.storage_rows += held if value else -held
            node.from_storage = value

    def remove_leaf(self, node: Node) -> None:
        """Drop a leaf with everything it holds."""
        parent, had_full = node.parent, node.full is not None
        for kind in KINDS:
            idx = getattr(node, kind)
            if idx is not None:
                self.pools[kind].free([idx])
                setattr(node, kind, None)
            hidx = getattr(node, "host_" + kind)
            if hidx is not None:
                self.host[kind].index.free([hidx])
                setattr(node, "host_" + kind, None)
                self.storage_rows -= node.from_storage
        self._unlink(node)
        if had_full:
            self.eviction.device_page_changed(parent, -1)

    def _unlink(self, node: Node) -> None:
        """Take an unlocked leaf out of its tree; drop the tree if that emptied it."""
        self.backups.forget(node)
        parent = node.parent
        node.tree_remove()
        self.eviction.forget(node)
        if not parent.is_root:
            self.eviction.offer(parent)  # a leaf now
        elif not parent.children:
            del self.trees[parent.tree.salt]

    def remove_subtree(self, node: Node) -> None:
        """Drop an unlocked node with everything below it, in every tier."""
        stack, order = [node], []
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        for x in reversed(order):  # leaves first
            self.remove_leaf(x)

    def prune(self, node: Node) -> None:
        """Drop ``node`` and its ancestors while they hold nothing and nobody needs them."""
        while (
            not node.is_root and node.empty and not node.children and not node.lock_ref and not node.swa_lock
        ):
            parent = node.parent
            self._unlink(node)
            node = parent

    def _rebuild_index(self) -> None:
        """Recount ``storage_rows`` and the eviction order from the trees (after a bulk
        change: flush, drop_device)."""
        self.storage_rows = 0
        everything = [n for t in self.trees.values() for n in t.post_order()]
        for n in everything:
            if n.from_storage:
                self.storage_rows += sum(getattr(n, "host_" + k) is not None for k in self.host)
        self.eviction.rebuild(everything)

    # ---- insertion ------------------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        start: Node | None,
        num_pages: int,
        pages: dict[str, list[int | None]],
        salt: str | None = None,
    ) -> tuple[Node, dict[str, set[int]]]:
        """Add pages ``start.depth .. num_pages-1`` of ``tokens`` below ``start`` (default the
        salt's root). ``pages[kind][j]`` is the caller's device index for page ``j`` (None:
        not held). Returns the last node and, per kind, the page numbers whose index the
        tree took: those now belong to the tree; the caller keeps (and frees) the rest."""
        tree = self.tree(salt)
        node = start or tree.root
        taken: dict[str, set[int]] = {k: set() for k in pages}
        path = []
        for j in range(node.depth, num_pages):
            key = tree.page_key(tokens, j)
            child = node.children.get(key) or tree.add_child(node, key)
            for kind, idx in pages.items():
                if idx[j] is not None and getattr(child, kind) is None:
                    self.set_device(child, kind, idx[j])
                    taken[kind].add(j)
                    self.backups.inserted(child)
            path.append(child)
            node = child
        RadixTree.touch(path)
        return node, taken

    def insert_host(
        self,
        tokens: Sequence[int],
        salt: str | None,
        data: dict[int, dict[str, dict[str, np.ndarray]]],
        hashes: Sequence[bytes],
        num_pages: int,
    ) -> int:
        """Put pages fetched from L3 into the host tier: ``data[j][kind]`` is page ``j``'s
        arrays. Returns the number of pages stored (stops when the host is full)."""
        tree = self.tree(salt)
        node = tree.root
        stored = 0
        path = []
        for j in range(num_pages):
            key = tree.page_key(tokens, j)
            node = node.children.get(key) or tree.add_child(node, key)
            node.hash = hashes[j]
            for kind, arrays in data.get(j, {}).items():
                if kind not in self.host or node.has(kind):
                    continue
                row = self.host_alloc(kind, 1)
                if row is None:
                    self.prune(node)
                    return stored
                self.host[kind].write(row, {k: v[None] for k, v in arrays.items()})
                self.set_host(node, kind, row[0])
                self.set_from_storage(node, True)
                stored += 1
            path.append(node)
        RadixTree.touch(path)
        return stored

    def lock(self, node: Node | None) -> None:
        if node is not None:
            RadixTree.lock(node)

    def unlock(self, node: Node | None) -> None:
        if node is not None:
            for n in RadixTree.unlock(node):
                self.eviction.offer(n)
            self.prune(node)

    def relock(self, old: Node | None, new: Node) -> None:
        """Move a lock from ``old`` down to its descendant ``new`` (lock(new), unlock(old)
        in the cost of the pages between them)."""
        RadixTree.lock(new, above=old)

    def swa_lock(self, nodes) -> None:
        for n in nodes:
            n.swa_lock += 1

    def swa_unlock(self, nodes) -> None:
        for n in nodes:
            if n.swa_lock <= 0:
                raise RuntimeError(f"swa-unlocking {n} below zero")
            n.swa_lock -= 1
            if not n.swa_lock and n.swa is not None:
                self.eviction.offer_device(CacheKind.SWA, n)

    # ---- maintenance ------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every unlocked node, device and host (everything when no request runs)."""
        for tree in list(self.trees.values()):
            for node in tree.post_order():  # a node's children go before it
                if not node.children and not node.lock_ref and not node.swa_lock:
                    self.remove_leaf(node)
        self.backups.clear()
        self._rebuild_index()

    def drop_device(self) -> None:
        """Forget every device index (the device cache was lost): device pools reset, nodes
        keep their host copies, nodes left with nothing are pruned. Nothing may be locked."""
        for node in list(self.nodes()):
            if node.lock_ref or node.swa_lock:
                raise RuntimeError(f"drop_device with {node} still locked")
            for kind in KINDS:
                setattr(node, kind, None)
        for pool in self.pools.values():
            pool.reset()
        self.backups.clear()
        for tree in list(self.trees.values()):
            for node in tree.post_order():
                if node.empty and not node.children:
                    self._unlink(node)
        self._rebuild_index()

    def tree_indices(self) -> dict[str, list[int]]:
        """Every device index the trees hold, by pool."""
        return {k: v for k, v in integrity.indices(self).items() if k in self.pools}

    def check_integrity(self, held_outside: dict[str, list[int]] | None = None) -> None:
        """Pools consistent, trees consistent, and every used index owned exactly once: by
        a tree or by ``held_outside`` (the running requests); see ``integrity.py``."""
        integrity.check_integrity(self, held_outside)

    # ---- the pools, as the engine asks about them -------------------------------------------
    def sequence_capacity(self) -> int:
        """The most tokens one sequence can hold on the device (a longer prompt could never
        run): the smallest page pool; sliding-only models hold a window, not the sequence."""
        capacity = min(p.size for k, p in self.pools.items() if k != CacheKind.STATE) * self.rules.page_size
        if CacheKind.FULL not in self.pools and CacheKind.STATE not in self.pools:
            capacity = 1 << 62
        return capacity

    def has_free_pages(self, n: int) -> bool:
        """Whether every page pool (not the state slots) has ``n`` free pages: ``n`` running
        sequences can each take one more page without evicting anything."""
        return all(p.num_free >= n for k, p in self.pools.items() if k != CacheKind.STATE)

    def metrics(self) -> Metrics:
        """Pool use (gauges) and the cache's counters."""
        out = Metrics()
        for kind, pool in self.pools.items():
            out.gauges({f"pool_{kind}_used": pool.num_used, f"pool_{kind}_size": pool.size})
        for kind, pool in self.host.items():
            out.gauges({f"host_pool_{kind}_used": pool.index.num_used, f"host_pool_{kind}_size": pool.size})
        return out.add(self.counters)

    def pages_in_use(self) -> dict[str, int]:
        """Used pages per device and host pool (all zero once flushed and idle)."""
        out = {f"device {k}": p.num_used for k, p in self.pools.items()}
        out.update({f"host {k}": p.index.num_used for k, p in self.host.items()})
        return out
