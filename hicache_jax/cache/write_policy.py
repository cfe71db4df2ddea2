"""When device data is copied to the host (L2), and the copies.

Write policies: ``write_through`` queues a node when it enters the tree,
``write_through_selective`` once it has been hit twice, ``write_back`` only when the device
evicts it (then it is copied at once, see ``eviction.py``). Queued nodes are copied, batched
per kind, by ``backup_pending`` (after each step; everything at a write-back flush). Every
completed copy is reported to ``on_backup`` (``cache/storage_tier.py`` sets it: it queues
the L3 write). A copy that finds the host pool full even after host eviction is skipped and
counted (``backup_skipped``).

``Backups`` is a part of ``PrefixCache`` (``prefix_cache.py``), which owns the trees and
pools; the host rows it fills are set through the cache's setters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache_jax.cache.radix import Node
from hicache_jax.metric_kinds import Metrics

if TYPE_CHECKING:
    from hicache_jax.cache.prefix_cache import PrefixCache


class Backups:
    def __init__(self, cache: PrefixCache, policy: str, counters: Metrics):
        self.cache = cache
        self.policy = policy
        self.counters = counters  # the cache's: this counts host_backups and backup_skipped
        self.pending: dict[int, Node] = {}  # id -> node, in insertion order
        self.on_backup: Callable[[Node, tuple[str, ...]], None] | None = None

    # ---- what the policy queues ------------------------------------------------------------
    def inserted(self, node: Node) -> None:
        """``node`` took a device page on insert."""
        if self.policy == "write_through":
            self.want(node)

    def hit(self, node: Node) -> None:
        """A match used ``node`` (its ``hit_count`` already counts this hit)."""
        if self.policy == "write_through_selective" and node.hit_count >= 2:
            self.want(node)

    def want(self, node: Node) -> None:
        host = self.cache.host
        if host and any(getattr(node, k) is not None and getattr(node, "host_" + k) is None for k in host):
            self.pending[id(node)] = node

    def forget(self, node: Node) -> None:
        """``node`` leaves its tree."""
        self.pending.pop(id(node), None)

    def clear(self) -> None:
        self.pending.clear()

    # ---- the copies ------------------------------------------------------------------------
    def backup_pending(self, everything: bool = False) -> int:
        """Copy queued nodes' device data to the host (batched per kind); ``everything``:
        every node with device data the host lacks (a write-back flush)."""
        nodes = [n for n in self.pending.values() if n.parent is not None]
        if everything:
            host = self.cache.host
            nodes = [n for n in self.cache.nodes() if any(getattr(n, k) is not None for k in host)]
        self.pending.clear()
        return self.backup(sorted(nodes, key=lambda n: n.depth))

    def backup(self, nodes: list[Node]) -> int:
        """Copy ``nodes``' device data the host lacks to the host; the number of pages copied."""
        cache = self.cache
        done: dict[int, list[str]] = {}
        for kind in cache.host:
            todo = [n for n in nodes if getattr(n, kind) is not None and getattr(n, "host_" + kind) is None]
            rows = []
            for _ in todo:
                got = cache.host_alloc(kind, 1)
                if got is None:
                    self.counters["backup_skipped"] += 1
                    break
                rows.append(got[0])
            todo = todo[: len(rows)]
            if not todo:
                continue
            data = cache.transfer.read(kind, [getattr(n, kind) for n in todo])
            cache.host[kind].write(rows, data)
            for n, r in zip(todo, rows):
                cache.set_host(n, kind, r)
                done.setdefault(id(n), []).append(kind)
            self.counters["host_backups"] += len(todo)
        if self.on_backup:
            for n in nodes:
                if id(n) in done:
                    self.on_backup(n, tuple(done[id(n)]))
        return sum(len(v) for v in done.values())
