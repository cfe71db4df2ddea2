"""Least recently used first, over a changing set of radix nodes, without scanning the tree.

One ``LruQueue`` per eviction pool (device full / sliding / state, and per host pool its
copies and its host-only pages). ``accepts(node)`` says whether a node is in the queue's
set *now* (evictable). The queue is a binary heap of ``(last_access, -depth, id, node)``
entries -- least recently used first, deeper first among nodes touched together -- kept
lazily:

* whenever a change may have let a node into the set (data arrived, a lock was released,
  its last child went ...), the cache ``offer``s it; it is pushed only if it has no entry
  yet (its bit in ``node.inq``), so a node has at most one entry per queue;
* a touch (``last_access`` grows) leaves the entry alone: an entry is never newer than
  its node;
* ``pop`` looks at the smallest entry: a stale one is re-keyed and pushed back, one whose
  node left the set (or the tree) is dropped, and the first fresh member is the answer.
  Every member has an entry no newer than itself, so that is the true least recently
  used member.

Each re-key pays for a touch, each drop for an ``offer``: the cost follows the changes,
never the tree. Entries of nodes taken out of the tree are dropped as they surface, and
the heap is rebuilt once they outnumber the live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from hicache_jax.cache.radix import Node


class LruQueue:
    __slots__ = ("name", "bit", "accepts", "heap", "live")

    def __init__(self, name: str, bit: int, accepts: Callable[[Node], bool]):
        self.name = name
        self.bit = bit
        self.accepts = accepts
        self.heap: list[tuple[int, int, int, Node]] = []
        self.live = 0  # nodes in the tree with an entry here (their bit set)

    def offer(self, node: Node) -> None:
        if not node.inq & self.bit and self.accepts(node):
            node.inq |= self.bit
            self.live += 1
            heapq.heappush(self.heap, (node.last_access, -node.depth, id(node), node))

    def pop(self) -> Node | None:
        """Take out the least recently used member (None: the set is empty)."""
        heap = self.heap
        while heap:
            key, neg_depth, nid, node = heap[0]
            if node.parent is None:  # left the tree (``forget`` counted it)
                heapq.heappop(heap)
            elif key != node.last_access:  # touched since: move it back
                heapq.heapreplace(heap, (node.last_access, neg_depth, nid, node))
            else:
                heapq.heappop(heap)
                node.inq &= ~self.bit
                self.live -= 1
                if self.accepts(node):
                    return node
        return None

    def forget(self, node: Node) -> None:
        """``node`` is leaving the tree; its entry is dropped when it surfaces."""
        if node.inq & self.bit:
            node.inq &= ~self.bit
            self.live -= 1
            if len(self.heap) > 2 * self.live + 64:
                self.heap = [e for e in self.heap if e[3].parent is not None and e[3] is not node]
                heapq.heapify(self.heap)

    def clear(self) -> None:
        """Empty the queue (the caller clears the nodes' bits)."""
        self.heap = []
        self.live = 0

    def check(self, nodes: list[Node]) -> None:
        """Every member has exactly one entry, no newer than itself; bits match entries."""
        entries: dict[int, int] = {}
        for key, _, nid, node in self.heap:
            if node.parent is None:
                continue
            if nid in entries:
                raise AssertionError(f"{self.name}: {node} has two entries")
            entries[nid] = key
        if len(entries) != self.live:
            raise AssertionError(f"{self.name}: {len(entries)} entries in the tree, {self.live} counted")
        for n in nodes:
            key = entries.get(id(n))
            if bool(n.inq & self.bit) != (key is not None):
                raise AssertionError(f"{self.name}: {n} bit {bool(n.inq & self.bit)}, entry {key}")
            if key is not None and key > n.last_access:
                raise AssertionError(f"{self.name}: {n} entry newer than the node")
            if key is None and self.accepts(n):
                raise AssertionError(f"{self.name}: evictable {n} has no entry")
