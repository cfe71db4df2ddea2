"""When device data is copied to the host (L2): the nodes that wait for a copy.

``write_through`` queues a node when it enters the tree, ``write_through_selective`` once
it has been hit twice, ``write_back`` never: the device's eviction copies it at once
(``eviction.py``). ``backups.py`` takes the queue and makes the copies.
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache_jax.cache.radix import Node


class WritePolicy:
    def __init__(self, policy: str, host_kinds: Iterable[str]):
        self.policy = policy
        self.host_kinds = tuple(host_kinds)
        self.pending: dict[int, Node] = {}  # id -> node, in insertion order

    def inserted(self, node: Node) -> None:
        """``node`` took a device page on insert."""
        if self.policy == "write_through":
            self.want(node)

    def hit(self, node: Node) -> None:
        """A match used ``node`` (its ``hit_count`` already counts this hit)."""
        if self.policy == "write_through_selective" and node.hit_count >= 2:
            self.want(node)

    def want(self, node: Node) -> None:
        host = self.host_kinds
        if host and any(k in node.dev and k not in node.host for k in host):
            self.pending[id(node)] = node

    def forget(self, node: Node) -> None:
        """``node`` leaves its tree."""
        self.pending.pop(id(node), None)

    def clear(self) -> None:
        self.pending.clear()

    def take(self) -> list[Node]:
        """The queued nodes still in a tree, in queue order; the queue empties."""
        nodes = [n for n in self.pending.values() if n.parent is not None]
        self.pending.clear()
        return nodes
