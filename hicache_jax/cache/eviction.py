"""Making room: a pool that is short frees its next victims (``eviction_order.py``) through
``Holdings``' setters. Evicting zero pages is always safe.

A page of an ``EVERY`` kind without a host copy is the only copy: it goes with its node, and
with the node's subtree, which then holds host copies only (they could never be matched
again without it). Under the ``write_back`` policy a page is first copied to the host
(``Backups.backup``, set as ``write_back``), and then only its device page goes.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_jax.cache.holdings import Holdings
from hicache_jax.cache.radix import Node
from hicache_jax.kinds import Retention, retention


class Eviction:
    def __init__(self, held: Holdings):
        self.held = held
        # Under write_back: copies nodes' device data the host lacks to the host.
        self.write_back: Callable[[list[Node]], object] | None = None

    def alloc(self, kind: str, n: int) -> list[int] | None:
        pool = self.held.pools[kind]
        if pool.num_free < n:
            self.evict(kind, n - pool.num_free)
        return pool.alloc(n)

    def host_alloc(self, kind: str, n: int) -> list[int] | None:
        pool = self.held.host[kind].index
        if pool.num_free < n:
            self.evict_host(kind, n - pool.num_free)
        return pool.alloc(n)

    def evict(self, kind: str, n: int) -> int:
        """Free at least ``n`` device indices of ``kind`` if unlocked nodes allow.

        Device data below a page without a host copy keeps it in place: the subtree's
        deeper, more recently used pages are evicted first; the last of them makes it
        evictable (``dev_kids`` drops to zero), within the same call."""
        held = self.held
        freed = 0
        while freed < n:
            node = held.order.victim(kind)
            if node is None:
                break
            if self.write_back is not None and kind not in node.host:
                self.write_back([node])
            if retention(kind) is Retention.EVERY and kind not in node.host:
                held.remove_subtree(node)
            else:
                held.pools[kind].free([node.dev[kind]])
                held.set_device(node, kind, None)
                held.prune(node)
            freed += 1
        return freed

    def evict_host(self, kind: str, n: int) -> int:
        """Free at least ``n`` host rows of ``kind``: copies of device data first, then
        host-only pages, least recently used first in each. (A node that asks for a row
        holds none of that kind, so it is never a candidate.)"""
        held = self.held
        pool = held.host[kind].index
        freed = 0
        while freed < n:
            node = held.order.host_victim(kind)
            if node is None:
                break
            if retention(kind) is Retention.EVERY and kind not in node.dev:
                held.remove_leaf(node)  # an unlocked leaf
            else:
                pool.free([node.host[kind]])
                held.set_host(node, kind, None)
                held.prune(node)
            freed += 1
        return freed
