"""The eviction rules and each pool's order: what may go, least recently used first.

Each pool may be short independently and has its own rule, by its kind's retention
(``hicache_jax/kinds.py``), never touching locked data:

- device ``EVERY`` pages: a node keeps its host copy; a node without one goes only as a
  whole leaf (its subtree would be unmatchable);
- device ``WINDOW`` pages: tombstoned outside every running request's window
  (``window_lock == 0``), anywhere in the tree;
- device ``SNAPSHOT`` entries: dropped from unlocked nodes;
- host pages: copies of data still on the device go first-come; host-only ``EVERY`` pages
  go as whole leaves.

Nothing here scans the trees per request or per step: each pool's order lives in an
``LruQueue`` (``lru.py``) that every change of a node's data, locks or children updates
(``Holdings``, ``holdings.py``, calls ``offer``), and ``dev_kids`` counts, per node, the
children with device ``EVERY`` pages at or below them (what a page without a host copy waits
for). The order changes no node's data: ``eviction.py`` takes its victims.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from hicache_jax.cache.lru import LruQueue
from hicache_jax.cache.radix import Node
from hicache_jax.kinds import Retention, retention


class EvictionOrder:
    def __init__(self, pool_kinds: Iterable[str], host_kinds: Iterable[str], write_back: bool):
        """One queue per device pool, and per host pool one for copies of device data (they
        go first) and one for host-only pages. ``write_back``: a device page is copied to
        the host as it is evicted."""
        pool_kinds, host_kinds = list(pool_kinds), list(host_kinds)
        # Write-back copies an EVERY page to the host before it goes: then only its device page goes.
        self.backed_up = frozenset(host_kinds if write_back else ())
        queues = [(k, k, self._evictable) for k in pool_kinds]
        queues += [(k, "host copy " + k, self._host_copy) for k in host_kinds]
        queues += [(k, "host only " + k, self._host_only) for k in host_kinds]
        self._queues = [
            LruQueue(name, 1 << b, functools.partial(f, kind=kind))
            for b, (kind, name, f) in enumerate(queues)
        ]
        self._all_bits = (1 << len(self._queues)) - 1
        n_dev, n_host = len(pool_kinds), len(host_kinds)
        self._device = {q.name: q for q in self._queues[:n_dev]}
        self._copies = dict(zip(host_kinds, self._queues[n_dev : n_dev + n_host]))
        self._host_only_q = dict(zip(host_kinds, self._queues[n_dev + n_host :]))

    # ---- the rules -------------------------------------------------------------------------
    def _evictable(self, node: Node, kind: str) -> bool:
        return self.may_evict(node, kind, device_below=lambda n: n.dev_kids > 0)

    def may_evict(self, node: Node, kind: str, device_below) -> bool:
        """The eviction rule for ``node``'s ``kind`` page; ``device_below(node)``: whether a
        device page hangs below it (a maintained count here; a scan in the tests)."""
        if kind not in node.dev:
            return False
        rule = retention(kind)
        if rule is Retention.WINDOW:
            return node.window_lock == 0
        if node.lock_ref:
            return False
        if rule is Retention.EVERY and kind not in node.host and node.children:
            if kind in self.backed_up:
                return True  # backed up on eviction, then only its device page goes
            return not device_below(node)  # goes with its host-only subtree
        return True

    @staticmethod
    def _host_copy(node: Node, kind: str) -> bool:
        """A host copy of data the device still holds: the first to go."""
        return kind in node.host and kind in node.dev

    @staticmethod
    def _host_only(node: Node, kind: str) -> bool:
        """The only copy: an EVERY page goes only as an unlocked leaf."""
        if kind not in node.host or kind in node.dev:
            return False
        return retention(kind) is not Retention.EVERY or not (node.children or node.lock_ref)

    # ---- the victims -----------------------------------------------------------------------
    def victim(self, kind: str) -> Node | None:
        """The least recently used evictable device page of ``kind``, taken off its queue."""
        return self._device[kind].pop()

    def host_victim(self, kind: str) -> Node | None:
        """The next host row of ``kind`` to drop, taken off its queue."""
        return self._copies[kind].pop() or self._host_only_q[kind].pop()

    # ---- keeping the order: ``Holdings`` calls these ---------------------------------------
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
        """A child of ``node`` started (+1) or stopped (-1) holding a device ``EVERY`` page at
        or below it: update ``dev_kids`` up to the first node whose own state stays."""
        while not node.is_root:
            node.dev_kids += delta
            if node.on_device:
                if not node.dev_kids:  # nothing on the device below it any more
                    for kind in node.dev:
                        if retention(kind) is Retention.EVERY:
                            self._device[kind].offer(node)
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
            n.dev_kids = sum(c.on_device or c.dev_kids > 0 for c in n.children.values())
        for n in everything:
            self.offer(n)

    def check(self, everything: list[Node]) -> None:
        for q in self._queues:
            q.check(everything)
