"""Which cached data goes when a pool is short: the eviction rules, the order, the victims.

Each pool may be short independently and has its own eviction, least recently used
first, never touching locked data:

- device full-attention pages: a node keeps its host copy; a node without one goes only
  as a whole leaf (its subtree would be unmatchable);
- device sliding-window pages: tombstoned outside every running request's window
  (``swa_lock == 0``), anywhere in the tree;
- device state snapshots: dropped from unlocked nodes;
- host pages: copies of data still on the device go first-come; host-only full pages go
  as whole leaves.

Nothing here scans the trees per request or per step: each pool's eviction order lives in
``LruQueue``s (``lru.py``) that every change of a node's data, locks or children updates
(the cache's setters call ``offer``), and ``dev_kids`` counts, per node, the children with
device full pages at or below them (what a page without a host copy waits for). Evicting
zero pages is always safe.

``Eviction`` is a part of ``PrefixCache`` (``prefix_cache.py``), which owns the trees and
pools; every node it frees is changed through the cache's setters.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from hicache_jax.cache.lru import LruQueue
from hicache_jax.cache.radix import Node
from hicache_jax.kinds import CacheKind

if TYPE_CHECKING:
    from hicache_jax.cache.prefix_cache import PrefixCache


class Eviction:
    def __init__(self, cache: PrefixCache):
        self.cache = cache
        pools, host = cache.pools, cache.host
        # Eviction order, per pool: device pages, then host copies of device data (they go
        # first) and host-only pages.
        queues = [(k, k, self._evictable) for k in pools]
        queues += [(k, "host copy " + k, self._host_copy) for k in host]
        queues += [(k, "host only " + k, self._host_only) for k in host]
        self._queues = [
            LruQueue(name, 1 << b, functools.partial(f, kind=kind))
            for b, (kind, name, f) in enumerate(queues)
        ]
        self._all_bits = (1 << len(self._queues)) - 1
        self._device = {q.name: q for q in self._queues[: len(pools)]}
        self._copies = {k: q for k, q in zip(host, self._queues[len(pools) :])}
        self._host_only_q = {k: q for k, q in zip(host, self._queues[len(pools) + len(host) :])}

    # ---- device and host allocation with eviction -----------------------------------------
    def alloc(self, kind: str, n: int) -> list[int] | None:
        pool = self.cache.pools[kind]
        if pool.num_free < n:
            self.evict(kind, n - pool.num_free)
        return pool.alloc(n)

    def host_alloc(self, kind: str, n: int) -> list[int] | None:
        pool = self.cache.host[kind].index
        if pool.num_free < n:
            self.evict_host(kind, n - pool.num_free)
        return pool.alloc(n)

    def evict(self, kind: str, n: int) -> int:
        """Free at least ``n`` device indices of ``kind`` if unlocked nodes allow.

        A full-attention page without a host copy is the only copy: it goes with its node,
        and with the node's subtree, which then holds host copies only (they could never be
        matched again without it). Device data below such a node keeps it in place: the
        subtree's deeper, more recently used pages are evicted first; the last of them
        makes it evictable (``dev_kids`` drops to zero), within the same call."""
        cache = self.cache
        freed = 0
        while freed < n:
            node = self.victim(kind)
            if node is None:
                break
            if cache.write_policy == "write_back" and getattr(node, "host_" + kind) is None:
                cache.backups.backup([node])
            if kind == CacheKind.FULL and node.host_full is None:
                cache.remove_subtree(node)
            else:
                cache.pools[kind].free([getattr(node, kind)])
                cache.set_device(node, kind, None)
                cache.prune(node)
            freed += 1
        return freed

    def evict_host(self, kind: str, n: int) -> int:
        """Free at least ``n`` host rows of ``kind``: copies of device data first, then
        host-only pages, least recently used first in each. (A node that asks for a row
        holds none of that kind, so it is never a candidate.)"""
        cache = self.cache
        pool = cache.host[kind].index
        freed = 0
        while freed < n:
            node = self.host_victim(kind)
            if node is None:
                break
            if kind == CacheKind.FULL and node.full is None:
                cache.remove_leaf(node)  # an unlocked leaf
            else:
                pool.free([getattr(node, "host_" + kind)])
                cache.set_host(node, kind, None)
                cache.prune(node)
            freed += 1
        return freed

    # ---- the rules -------------------------------------------------------------------------
    def _evictable(self, node: Node, kind: str) -> bool:
        return self.may_evict(node, kind, device_below=lambda n: n.dev_kids > 0)

    def may_evict(self, node: Node, kind: str, device_below) -> bool:
        """The eviction rule for ``node``'s ``kind`` page; ``device_below(node)``: whether a
        device page hangs below it (a maintained count here; a scan in the tests)."""
        if getattr(node, kind) is None:
            return False
        if kind == CacheKind.SWA:
            return node.swa_lock == 0
        if node.lock_ref:
            return False
        if kind == CacheKind.FULL and node.host_full is None and node.children:
            if self.cache.write_policy == "write_back" and CacheKind.FULL in self.cache.host:
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
        return kind != CacheKind.FULL or not (node.children or node.lock_ref)

    # ---- the victims -----------------------------------------------------------------------
    def victim(self, kind: str) -> Node | None:
        """The least recently used evictable device page of ``kind``, taken off its queue."""
        return self._device[kind].pop()

    def host_victim(self, kind: str) -> Node | None:
        """The next host row of ``kind`` to drop, taken off its queue."""
        return self._copies[kind].pop() or self._host_only_q[kind].pop()

    # ---- keeping the order: the cache's setters call these --------------------------------
    def offer(self, node: Node) -> None:
        """``node``'s data, locks or children changed: it may have joined a pool's set."""
        inq = node.inq
        if inq != self._all_bits:
            for q in self._queues:
                if not inq & q.bit:
                    q.offer(node)

    def offer_device(self, kind: str, node: Node) -> None:
        """``node``'s device ``kind`` page may have become evictable."""
        self._device[kind].offer(node)

    def forget(self, node: Node) -> None:
        """``node`` leaves its tree."""
        if node.inq:
            for q in self._queues:
                q.forget(node)

    def device_page_changed(self, node: Node, delta: int) -> None:
        """A child of ``node`` started (+1) or stopped (-1) holding a device full page at or
        below it: update ``dev_kids`` up to the first node whose own state stays."""
        while not node.is_root:
            node.dev_kids += delta
            if node.full is not None:
                if not node.dev_kids:  # nothing on the device below it any more
                    self._device[CacheKind.FULL].offer(node)
                return
            if node.dev_kids != (delta > 0):  # not 0 -> 1 or 1 -> 0: its state stays
                return
            node = node.parent

    def rebuild(self, everything: list[Node]) -> None:
        """Recount ``dev_kids`` and refill the queues from ``everything`` (every node, children
        before parents), after a bulk change: flush, drop_device."""
        for q in self._queues:
            q.clear()
        for n in everything:
            n.inq = 0
            n.dev_kids = sum(c.full is not None or c.dev_kids > 0 for c in n.children.values())
        for n in everything:
            self.offer(n)

    def check(self, everything: list[Node]) -> None:
        for q in self._queues:
            q.check(everything)
