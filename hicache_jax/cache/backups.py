"""Copies of device data to the host (L2).

The nodes the write policy queued (``write_policy.py``) are copied, batched per kind, by
``backup_pending`` (after each step; everything at a write-back flush); under
``write_back`` the device's eviction calls ``backup`` for its victim (``eviction.py``).
Every completed copy is reported to ``on_backup`` (``cache/storage_tier.py`` sets it: it
queues the L3 write). A copy that finds the host pool full even after host eviction is
skipped and counted (``backup_skipped``). The rows are set through ``Holdings``.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_jax.cache.holdings import Holdings
from hicache_jax.cache.radix import Node
from hicache_jax.cache.write_policy import WritePolicy
from hicache_jax.metric_kinds import Metrics


class Backups:
    def __init__(
        self,
        held: Holdings,
        write_policy: WritePolicy,
        host_alloc: Callable[[str, int], list[int] | None],
        transfer,  # .read(kind, device_idx) -> arrays
        counters: Metrics,
    ):
        """``host_alloc``: host rows, evicting host data for them (``Eviction.host_alloc``)."""
        self.held = held
        self.write_policy = write_policy
        self.host_alloc = host_alloc
        self.transfer = transfer
        self.counters = counters  # the cache's: this counts host_backups and backup_skipped
        self.on_backup: Callable[[Node, tuple[str, ...]], None] | None = None

    def backup_pending(self, everything: bool = False) -> int:
        """Copy queued nodes' device data to the host (batched per kind); ``everything``:
        every node with device data the host lacks (a write-back flush)."""
        nodes = self.write_policy.take()
        if everything:
            host = self.held.host
            nodes = [n for n in self.held.nodes() if any(k in n.dev for k in host)]
        return self.backup(sorted(nodes, key=lambda n: n.depth))

    def backup(self, nodes: list[Node]) -> int:
        """Copy ``nodes``' device data the host lacks to the host; the number of pages copied."""
        held = self.held
        done: dict[int, list[str]] = {}
        for kind in held.host:
            todo = [n for n in nodes if kind in n.dev and kind not in n.host]
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
            data = self.transfer.read(kind, [n.dev[kind] for n in todo])
            held.host[kind].write(rows, data)
            for n, r in zip(todo, rows):
                held.set_host(n, kind, r)
                done.setdefault(id(n), []).append(kind)
            self.counters["host_backups"] += len(todo)
        if self.on_backup:
            for n in nodes:
                if id(n) in done:
                    self.on_backup(n, tuple(done[id(n)]))
        return sum(len(v) for v in done.values())
