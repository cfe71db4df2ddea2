"""The device (L1) prefix cache: pools, radix tree and eviction, behind a request-free API.

Three pools may be short independently; each has its own eviction:

- full-attention pages: evict whole unlocked leaves, least recently used first;
- sliding-window pages: tombstone SWA pages outside every running request's window
  (``swa_lock == 0``), LRU, anywhere in the tree;
- Mamba state slots: drop unlocked nodes' snapshots (LRU).

Evicting zero pages is always safe; locked nodes are never touched. A node left holding
nothing is pruned once it is a leaf.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.cache.radix import Node, RadixTree

KINDS = ("full", "swa", "mamba")


@dataclasses.dataclass
class Match:
    nodes: list[Node]  # the path whose pages are reused, root excluded
    end: int  # tokens: len(nodes) * page_size

    @property
    def last(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None


class PrefixCache:
    def __init__(
        self,
        rules: PrefixRules,
        pools: dict[str, IndexPool],  # subset of KINDS the model uses
        *,
        enabled: bool = True,
    ):
        self.rules = rules
        self.pools = pools
        self.enabled = enabled
        self.tree = RadixTree(rules.page_size)

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], input_len: int, logprob_start_len: int = -1) -> Match:
        if not self.enabled:
            return Match([], 0)
        P = self.rules.page_size
        path = self.tree.walk(tokens, self.rules.max_end(input_len, logprob_start_len) // P)
        end = usable_prefix_end(
            self.rules,
            input_len,
            logprob_start_len,
            [n.full is not None for n in path],
            [n.swa is not None for n in path],
            [n.mamba is not None for n in path],
        )
        nodes = path[: end // P]
        self.tree.touch(nodes)
        return Match(nodes, end)

    # ---- allocation with eviction --------------------------------------------------------
    def alloc(self, kind: str, n: int) -> list[int] | None:
        pool = self.pools[kind]
        if pool.num_free < n:
            self.evict(kind, n - pool.num_free)
        return pool.alloc(n)

    def available(self, kind: str) -> int:
        """Free now plus what eviction could free (an upper bound for admission)."""
        pool = self.pools.get(kind)
        if pool is None:
            return 1 << 30
        return pool.num_free + sum(1 for node in self.tree.nodes() if self._evictable(node, kind))

    @staticmethod
    def _evictable(node: Node, kind: str) -> bool:
        if getattr(node, kind) is None:
            return False
        return node.swa_lock == 0 if kind == "swa" else node.lock_ref == 0

    def evict(self, kind: str, n: int) -> int:
        """Free at least ``n`` indices of ``kind`` if unlocked nodes allow; returns how many."""
        if n <= 0:
            return 0
        if kind == "full":
            return self._evict_leaves(n)
        freed = 0
        heap = [(x.last_access, id(x), x) for x in self.tree.nodes() if self._evictable(x, kind)]
        heapq.heapify(heap)
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            self.pools[kind].free([getattr(node, kind)])
            setattr(node, kind, None)
            freed += 1
            self._prune(node)
        return freed

    def _evict_leaves(self, n: int) -> int:
        freed = 0
        heap = [
            (x.last_access, id(x), x)
            for x in self.tree.nodes()
            if not x.children and x.lock_ref == 0 and x.swa_lock == 0
        ]
        heapq.heapify(heap)
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            freed += node.full is not None
            parent = self._drop_node(node)
            if not parent.is_root and not parent.children and parent.lock_ref == 0 and parent.swa_lock == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _drop_node(self, node: Node) -> Node:
        for kind in KINDS:
            idx = getattr(node, kind)
            if idx is not None:
                self.pools[kind].free([idx])
                setattr(node, kind, None)
        self.tree.remove_leaf(node)
        return node.parent

    def _prune(self, node: Node) -> None:
        while (
            not node.is_root and node.empty and not node.children and not node.lock_ref and not node.swa_lock
        ):
            parent = node.parent
            self.tree.remove_leaf(node)
            node = parent

    # ---- insertion ------------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        start: Node | None,
        num_pages: int,
        pages: dict[str, list[int | None]],
    ) -> tuple[Node, dict[str, set[int]]]:
        """Add pages ``start.depth .. num_pages-1`` of ``tokens`` below ``start`` (default the
        root). ``pages[kind][j]`` is the caller's index for page ``j`` (None: not held).
        Returns the last node and, per kind, the page numbers whose index the tree took:
        those now belong to the tree; the caller keeps (and later frees) the rest."""
        node = start or self.tree.root
        taken: dict[str, set[int]] = {k: set() for k in pages}
        for j in range(node.depth, num_pages):
            key = self.tree.page_key(tokens, j)
            child = node.children.get(key)
            if child is None:
                child = self.tree.add_child(node, key)
            for kind, idx in pages.items():
                if idx[j] is not None and getattr(child, kind) is None:
                    setattr(child, kind, idx[j])
                    taken[kind].add(j)
            node = child
        self.tree.touch(self.tree.path_to(node)[start.depth if start else 0 :])
        return node, taken

    def lock(self, node: Node | None) -> None:
        if node is not None:
            self.tree.lock(node)

    def unlock(self, node: Node | None) -> None:
        if node is not None:
            self.tree.unlock(node)
            self._prune(node)

    def swa_lock(self, nodes) -> None:
        for n in nodes:
            n.swa_lock += 1

    def swa_unlock(self, nodes) -> None:
        for n in nodes:
            if n.swa_lock <= 0:
                raise RuntimeError(f"swa-unlocking {n} below zero")
            n.swa_lock -= 1

    # ---- maintenance ------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every unlocked node (all of them when no request runs)."""
        self._evict_leaves(1 << 62)
        for kind in self.pools:
            if kind != "full":
                self.evict(kind, 1 << 62)

    def tree_indices(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {k: [] for k in self.pools}
        for node in self.tree.nodes():
            for kind in self.pools:
                idx = getattr(node, kind)
                if idx is not None:
                    out[kind].append(idx)
        return out

    def check_integrity(self, held_outside: dict[str, list[int]] | None = None) -> None:
        """Pools consistent, tree consistent, and every used index owned exactly once: by
        the tree or by ``held_outside`` (the running requests)."""
        self.tree.check_integrity()
        held_outside = held_outside or {}
        tree = self.tree_indices()
        for kind, pool in self.pools.items():
            pool.check_integrity()
            owners = tree[kind] + list(held_outside.get(kind, []))
            if len(owners) != len(set(owners)):
                dup = sorted({i for i in owners if owners.count(i) > 1})[:8]
                raise AssertionError(f"{pool.name}: indices owned twice: {dup}")
            if set(owners) != pool.used():
                leaked = sorted(pool.used() - set(owners))[:8]
                unalloc = sorted(set(owners) - pool.used())[:8]
                raise AssertionError(f"{pool.name}: leaked {leaked}, owned but not allocated {unalloc}")
