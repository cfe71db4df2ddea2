"""The prefix cache over device (L1) and, optionally, host (L2) memory, behind a
request-free API.

Each pool may be short independently and has its own eviction, least recently used
first, never touching locked data:

- device full-attention pages: a node keeps its host copy; a node without one goes only
  as a whole leaf (its subtree would be unmatchable);
- device sliding-window pages: tombstoned outside every running request's window
  (``swa_lock == 0``), anywhere in the tree;
- device Mamba snapshots: dropped from unlocked nodes;
- host pages: copies of data still on the device go first-come; host-only full pages go
  as whole leaves.

Write policies decide when device data is copied to the host: ``write_through`` when a
node enters the tree, ``write_through_selective`` once it has been hit twice,
``write_back`` only when the device evicts it. Every completed copy is reported to
``on_backup`` (which queues the L3 write). Evicting zero pages is always safe.

Nothing here scans the trees per request or per step: each pool's eviction order lives in
``LruQueue``s (``lru.py``) that every change of a node's data, locks or children updates,
and ``dev_kids`` counts, per node, the children with device full pages at or below them
(what a page without a host copy waits for). Only maintenance (flush, drop_device,
check_integrity) walks everything.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.lru import LruQueue
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.cache.radix import Node, RadixTree
from hicache_jax.metric_kinds import Metrics

KINDS = ("full", "swa", "mamba")


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
        self.pending_backup: dict[int, Node] = {}  # id -> node, in insertion order
        self.on_backup: Callable[[Node, tuple[str, ...]], None] | None = None
        self.counters = Metrics().counters({"host_loads": 0, "host_backups": 0, "backup_skipped": 0})
        self.storage_rows = 0  # host rows of nodes L3 filled that no match used yet
        # Eviction order, per pool: device pages, then host copies of device data (they go
        # first) and host-only pages.
        queues = [(k, k, self._evictable) for k in pools]
        queues += [(k, "host copy " + k, self._host_copy) for k in self.host]
        queues += [(k, "host only " + k, self._host_only) for k in self.host]
        self._queues = [
            LruQueue(name, 1 << b, functools.partial(f, kind=kind))
            for b, (kind, name, f) in enumerate(queues)
        ]
        self._all_bits = (1 << len(self._queues)) - 1
        self._device = {q.name: q for q in self._queues[: len(pools)]}
        self._copies = {k: q for k, q in zip(self.host, self._queues[len(pools) :])}
        self._host_only_q = {k: q for k, q in zip(self.host, self._queues[len(pools) + len(self.host) :])}

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
        return (
            [n.has("full") for n in path],
            [n.has("swa") for n in path],
            [n.has("mamba") for n in path],
        )

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
        window = set(self.rules.swa_pages_needed(end)) if "swa" in self.pools else set()
        page_tier = []
        for j, node in enumerate(nodes):
            need = [k for k in ("full",) if k in self.pools]
            need += ["swa"] if j in window else []
            need += ["mamba"] if "mamba" in self.pools and j == len(nodes) - 1 else []
            missing = [k for k in need if getattr(node, k) is None]
            match.loads += [(k, node) for k in missing]
            tier = (
                None if not need else "device" if not missing else "storage" if node.from_storage else "host"
            )
            page_tier.append(tier)
            node.hit_count += 1
            if self.write_policy == "write_through_selective" and node.hit_count >= 2:
                self._want_backup(node)
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
                self._set(n, kind, i)
            self.counters["host_loads"] += len(nodes)
        for n in match.nodes:
            self._set_from_storage(n, False)
        match.loads = []
        return True

    # ---- device allocation with eviction ---------------------------------------------------
    def alloc(self, kind: str, n: int) -> list[int] | None:
        pool = self.pools[kind]
        if pool.num_free < n:
            self.evict(kind, n - pool.num_free)
        return pool.alloc(n)

    def _evictable(self, node: Node, kind: str) -> bool:
        return self.may_evict(node, kind, device_below=lambda n: n.dev_kids > 0)

    def may_evict(self, node: Node, kind: str, device_below) -> bool:
        """The eviction rule for ``node``'s ``kind`` page; ``device_below(node)``: whether a
        device page hangs below it (a maintained count here; a scan in the tests)."""
        if getattr(node, kind) is None:
            return False
        if kind == "swa":
            return node.swa_lock == 0
        if node.lock_ref:
            return False
        if kind == "full" and node.host_full is None and node.children:
            if self.write_policy == "write_back" and "full" in self.host:
                return True  # backed up on eviction, then only its device page goes
            return not device_below(node)  # goes with its host-only subtree
        return True

    @staticmethod
    def _host_copy(node: Node, kind: str) -> bool:
        """A host copy of data the device still holds: the first to go."""
        return getattr(node, "host_" + kind) is not None and getattr(node, kind) is not None

    @staticmethod
    def _host_only(node: Node, kind: str) -> bool:
        """The only copy: a full page goes only as an unlocked leaf."""
        if getattr(node, "host_" + kind) is None or getattr(node, kind) is not None:
            return False
        return kind != "full" or not (node.children or node.lock_ref)

    def evict(self, kind: str, n: int) -> int:
        """Free at least ``n`` device indices of ``kind`` if unlocked nodes allow.

        A full-attention page without a host copy is the only copy: it goes with its node,
        and with the node's subtree, which then holds host copies only (they could never be
        matched again without it). Device data below such a node keeps it in place: the
        subtree's deeper, more recently used pages are evicted first; the last of them
        makes it evictable (``dev_kids`` drops to zero), within the same call."""
        freed = 0
        while freed < n:
            node = self._victim(kind)
            if node is None:
                break
            if self.write_policy == "write_back" and getattr(node, "host_" + kind) is None:
                self._backup([node])
            if kind == "full" and node.host_full is None:
                self._remove_subtree(node)
            else:
                self.pools[kind].free([getattr(node, kind)])
                self._set(node, kind, None)
                self._prune(node)
            freed += 1
        return freed

    def evict_host(self, kind: str, n: int) -> int:
        """Free at least ``n`` host rows of ``kind``: copies of device data first, then
        host-only pages, least recently used first in each. (A node that asks for a row
        holds none of that kind, so it is never a candidate.)"""
        pool = self.host[kind].index
        freed = 0
        while freed < n:
            node = self._host_victim(kind)
            if node is None:
                break
            if kind == "full" and node.full is None:
                self._remove(node)  # an unlocked leaf
            else:
                pool.free([getattr(node, "host_" + kind)])
                self._set_host(node, kind, None)
                self._prune(node)
            freed += 1
        return freed

    def _victim(self, kind: str) -> Node | None:
        """The least recently used evictable device page of ``kind``, taken off its queue."""
        return self._device[kind].pop()

    def _host_victim(self, kind: str) -> Node | None:
        """The next host row of ``kind`` to drop, taken off its queue."""
        return self._copies[kind].pop() or self._host_only_q[kind].pop()

    def host_alloc(self, kind: str, n: int) -> list[int] | None:
        pool = self.host[kind].index
        if pool.num_free < n:
            self.evict_host(kind, n - pool.num_free)
        return pool.alloc(n)

    # ---- every change to a node's data goes through these (they keep the queues) -----------
    def _offer(self, node: Node) -> None:
        inq = node.inq
        if inq != self._all_bits:
            for q in self._queues:
                if not inq & q.bit:
                    q.offer(node)

    def _set(self, node: Node, kind: str, idx: int | None) -> None:
        """Set a device index (None: gone)."""
        was = getattr(node, kind) is not None
        setattr(node, kind, idx)
        if kind == "full" and was != (idx is not None) and not node.dev_kids:
            self._hot_changed(node.parent, 1 if idx is not None else -1)
        self._offer(node)

    def _set_host(self, node: Node, kind: str, row: int | None) -> None:
        """Set a host row (None: gone)."""
        if node.from_storage:
            self.storage_rows += (row is not None) - (getattr(node, "host_" + kind) is not None)
        setattr(node, "host_" + kind, row)
        self._offer(node)

    def _set_from_storage(self, node: Node, value: bool) -> None:
        if node.from_storage != value:
            held = sum(getattr(node, "host_" + k) is not None for k in self.host)
            self.storage_rows += held if value else -held
            node.from_storage = value

    def _hot_changed(self, node: Node, delta: int) -> None:
        """A child of ``node`` started (+1) or stopped (-1) holding a device full page at or
        below it: update ``dev_kids`` up to the first node whose own state stays."""
        while not node.is_root:
            node.dev_kids += delta
            if node.full is not None:
                if not node.dev_kids:  # nothing on the device below it any more
                    self._device["full"].offer(node)
                return
            if node.dev_kids != (delta > 0):  # not 0 -> 1 or 1 -> 0: its state stays
                return
            node = node.parent

    def _remove(self, node: Node) -> None:
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
            self._hot_changed(parent, -1)

    def _unlink(self, node: Node) -> None:
        """Take an unlocked leaf out of its tree; drop the tree if that emptied it."""
        self.pending_backup.pop(id(node), None)
        parent = node.parent
        node.tree_remove()
        if node.inq:
            for q in self._queues:
                q.forget(node)
        if not parent.is_root:
            self._offer(parent)  # a leaf now
        elif not parent.children:
            del self.trees[parent.tree.salt]

    def _remove_subtree(self, node: Node) -> None:
        """Drop an unlocked node with everything below it, in every tier."""
        stack, order = [node], []
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        for x in reversed(order):  # leaves first
            self._remove(x)

    def _prune(self, node: Node) -> None:
        while (
            not node.is_root and node.empty and not node.children and not node.lock_ref and not node.swa_lock
        ):
            parent = node.parent
            self._unlink(node)
            node = parent

    def _rebuild_index(self) -> None:
        """Recount ``dev_kids`` and ``storage_rows`` and refill the queues from the trees
        (after a bulk change: flush, drop_device)."""
        for q in self._queues:
            q.clear()
        self.storage_rows = 0
        everything = [n for t in self.trees.values() for n in t.post_order()]
        for n in everything:
            n.inq = 0
            n.dev_kids = sum(c.full is not None or c.dev_kids > 0 for c in n.children.values())
            if n.from_storage:
                self.storage_rows += sum(getattr(n, "host_" + k) is not None for k in self.host)
        for n in everything:
            self._offer(n)

    # ---- host backups ------------------------------------------------------------------------
    def _want_backup(self, node: Node) -> None:
        if self.host and any(
            getattr(node, k) is not None and getattr(node, "host_" + k) is None for k in self.host
        ):
            self.pending_backup[id(node)] = node

    def backup_pending(self, everything: bool = False) -> int:
        """Copy queued nodes' device data to the host (batched per kind); ``everything``:
        every node with device data the host lacks (a write-back flush)."""
        nodes = [n for n in self.pending_backup.values() if n.parent is not None]
        if everything:
            nodes = [n for n in self.nodes() if any(getattr(n, k) is not None for k in self.host)]
        self.pending_backup.clear()
        return self._backup(sorted(nodes, key=lambda n: n.depth))

    def _backup(self, nodes: list[Node]) -> int:
        done: dict[int, list[str]] = {}
        for kind in self.host:
            todo = [n for n in nodes if getattr(n, kind) is not None and getattr(n, "host_" + kind) is None]
            rows = []
            for _ in todo:
                got = self.host_alloc(kind, 1)
                if got is None:
                    self.counters["backup_skipped"] += 1
                    break
                rows.append(got[0])
            todo = todo[: len(rows)]
            if not todo:
                continue
            data = self.transfer.read(kind, [getattr(n, kind) for n in todo])
            self.host[kind].write(rows, data)
            for n, r in zip(todo, rows):
                self._set_host(n, kind, r)
                done.setdefault(id(n), []).append(kind)
            self.counters["host_backups"] += len(todo)
        if self.on_backup:
            for n in nodes:
                if id(n) in done:
                    self.on_backup(n, tuple(done[id(n)]))
        return sum(len(v) for v in done.values())

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
                    self._set(child, kind, idx[j])
                    taken[kind].add(j)
                    if self.write_policy == "write_through":
                        self._want_backup(child)
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
                    self._prune(node)
                    return stored
                self.host[kind].write(row, {k: v[None] for k, v in arrays.items()})
                self._set_host(node, kind, row[0])
                self._set_from_storage(node, True)
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
                self._offer(n)
            self._prune(node)

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
                self._device["swa"].offer(n)

    # ---- maintenance ------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every unlocked node, device and host (everything when no request runs)."""
        for tree in list(self.trees.values()):
            for node in tree.post_order():  # a node's children go before it
                if not node.children and not node.lock_ref and not node.swa_lock:
                    self._remove(node)
        self.pending_backup.clear()
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
        self.pending_backup.clear()
        for tree in list(self.trees.values()):
            for node in tree.post_order():
                if node.empty and not node.children:
                    self._unlink(node)
        self._rebuild_index()

    def indices(self) -> dict[str, list[int]]:
        """Every device and host index the trees hold, by pool."""
        out: dict[str, list[int]] = {k: [] for k in self.pools}
        out.update({"host_" + k: [] for k in self.host})
        for node in self.nodes():
            for kind in self.pools:
                if getattr(node, kind) is not None:
                    out[kind].append(getattr(node, kind))
            for kind in self.host:
                if getattr(node, "host_" + kind) is not None:
                    out["host_" + kind].append(getattr(node, "host_" + kind))
        return out

    def tree_indices(self) -> dict[str, list[int]]:
        return {k: v for k, v in self.indices().items() if k in self.pools}

    def check_integrity(self, held_outside: dict[str, list[int]] | None = None) -> None:
        """Pools consistent, trees consistent, and every used index owned exactly once: by
        a tree or by ``held_outside`` (the running requests)."""
        for t in self.trees.values():
            t.check_integrity()
        everything = list(self.nodes())
        for q in self._queues:
            q.check(everything)
        rows = sum(
            getattr(n, "host_" + k) is not None for n in everything if n.from_storage for k in self.host
        )
        if rows != self.storage_rows:
            raise AssertionError(f"storage_rows {self.storage_rows}, but nodes from L3 hold {rows} host rows")
        held_outside = held_outside or {}
        owned = self.indices()
        all_pools = dict(self.pools) | {"host_" + k: h.index for k, h in self.host.items()}
        for kind, pool in all_pools.items():
            pool.check_integrity()
            owners = owned[kind] + list(held_outside.get(kind, []))
            if len(owners) != len(set(owners)):
                dup = sorted({i for i in owners if owners.count(i) > 1})[:8]
                raise AssertionError(f"{pool.name}: indices owned twice: {dup}")
            if set(owners) != pool.used():
                leaked = sorted(pool.used() - set(owners))[:8]
                unalloc = sorted(set(owners) - pool.used())[:8]
                raise AssertionError(f"{pool.name}: leaked {leaked}, owned but not allocated {unalloc}")
