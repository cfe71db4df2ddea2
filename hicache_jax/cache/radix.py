"""Page-granular radix tree of cached prefixes.

One node per page of ``page_size`` tokens; a node's key is that page's token ids, so the
path from the root spells a prefix. A node holds, per layer kind, what the cache keeps for
its page (device indices; ``None`` = not held):

- ``full``:  the full-attention KV page;
- ``swa``:   the sliding-window KV page (``None`` on a node that still has other data is a
  *tombstone*: a match may pass through it but never end right after it);
- ``state``: a recurrent-state snapshot (every recurrent layer) taken at the end of the page.

With a host tier (L2) each kind may also have a host copy (``host_full`` ...). A node
whose device data was evicted but whose host copy remains stays in the tree; a match may
use it, and the engine loads it back to the device.

``lock_ref`` counts running requests whose prefix ends at or below the node; a locked node
is never evicted and keeps its full KV and snapshot. ``swa_lock`` counts running requests
whose sliding window covers the node: only those pin its SWA page, so a long prompt's
older SWA pages become evictable while the request still runs. The tree holds indices
only; pools free them.

Every operation here costs the path it walks, never the size of the tree: eviction order
is kept by the prefix cache's LRU queues (``eviction_order.py``, ``lru.py``), which use
``inq`` and ``dev_kids``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

_clock = itertools.count(1)


class Node:
    __slots__ = (
        "key",
        "parent",
        "children",
        "full",
        "swa",
        "state",
        "host_full",
        "host_swa",
        "host_state",
        "lock_ref",
        "swa_lock",
        "last_access",
        "depth",
        "hit_count",
        "hash",
        "from_storage",
        "tree",
        "inq",
        "dev_kids",
    )

    def __init__(self, key: tuple[int, ...], parent: Node | None, tree: RadixTree | None = None):
        self.key = key
        self.parent = parent
        self.tree = tree if parent is None else parent.tree  # the tree it was made in
        self.children: dict[tuple[int, ...], Node] = {}
        self.full: int | None = None
        self.swa: int | None = None
        self.state: int | None = None
        self.host_full: int | None = None
        self.host_swa: int | None = None
        self.host_state: int | None = None
        self.hit_count = 0
        self.hash: bytes | None = None  # chained page hash (L3 key), computed on demand
        self.from_storage = False  # its host data came from L3 and was not used yet
        self.lock_ref = 0
        self.swa_lock = 0
        self.last_access = next(_clock)
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root
        self.inq = 0  # bit per LRU queue that holds an entry for it (lru.LruQueue)
        self.dev_kids = 0  # children whose subtree (child included) holds a device full page

    @property
    def is_root(self) -> bool:
        return self.depth == 0

    @property
    def empty(self) -> bool:
        return self.device_empty and self.host_empty

    @property
    def device_empty(self) -> bool:
        return self.full is None and self.swa is None and self.state is None

    @property
    def host_empty(self) -> bool:
        return self.host_full is None and self.host_swa is None and self.host_state is None

    def tree_remove(self) -> None:
        """Unlink an unlocked leaf from its parent."""
        if self.children or self.parent is None or self.lock_ref or self.swa_lock:
            raise RuntimeError(f"cannot remove {self}: not an unlocked leaf")
        del self.parent.children[self.key]
        self.parent = None

    def has(self, kind: str) -> bool:
        """The kind's data is in some tier."""
        return getattr(self, kind) is not None or getattr(self, "host_" + kind) is not None

    def __repr__(self) -> str:
        host = f", host=({self.host_full}, {self.host_swa}, {self.host_state})" if not self.host_empty else ""
        return (
            f"Node(depth={self.depth}, full={self.full}, swa={self.swa}, state={self.state}{host}, "
            f"lock={self.lock_ref}, swa_lock={self.swa_lock})"
        )


def path_to(node: Node) -> list[Node]:
    """Nodes from the root (excluded) down to ``node``."""
    path = []
    while not node.is_root:
        path.append(node)
        node = node.parent
    return path[::-1]


class RadixTree:
    def __init__(self, page_size: int, salt: str | None = None):
        self.page_size = page_size
        self.salt = salt  # the tenant (cache_salt) whose prefixes this tree holds
        self.root = Node((), None, self)

    def page_key(self, tokens: Sequence[int], page: int) -> tuple[int, ...]:
        P = self.page_size
        return tuple(map(int, tokens[page * P : (page + 1) * P]))

    def walk(self, tokens: Sequence[int], max_pages: int, start: Node | None = None) -> list[Node]:
        """Existing nodes along ``tokens``' full pages (at most ``max_pages`` from the root),
        starting below ``start`` (default: the root)."""
        node = start or self.root
        path: list[Node] = []
        for page in range(node.depth, max_pages):
            node = node.children.get(self.page_key(tokens, page))
            if node is None:
                break
            path.append(node)
        return path

    def add_child(self, parent: Node, key: tuple[int, ...]) -> Node:
        if len(key) != self.page_size:
            raise ValueError(f"a node key must be one full page ({self.page_size} tokens), got {len(key)}")
        node = Node(key, parent)
        parent.children[key] = node
        return node

    @staticmethod
    def touch(nodes: Sequence[Node]) -> None:
        tick = next(_clock)
        for n in nodes:
            n.last_access = tick

    @staticmethod
    def lock(node: Node, above: Node | None = None) -> None:
        """Lock ``node`` and its ancestors, stopping below ``above`` (an ancestor that is
        locked already: moving a lock down a path costs only the pages in between)."""
        path = []
        while node is not above:
            if node.is_root:
                if above is None:
                    break
                raise RuntimeError(f"{above} is not an ancestor of the node to lock")
            path.append(node)
            node = node.parent
        for n in path:
            n.lock_ref += 1

    @staticmethod
    def unlock(node: Node) -> list[Node]:
        """Unlock ``node`` and its ancestors; returns those no request locks any more."""
        freed = []
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlocking {node} below zero")
            node.lock_ref -= 1
            if not node.lock_ref:
                freed.append(node)
            node = node.parent
        return freed

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def post_order(self) -> list[Node]:
        """Every node (root excluded), each after all of its children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out[::-1]

    def check_integrity(self) -> None:
        for n in self.nodes():
            if n.lock_ref < 0 or n.swa_lock < 0:
                raise AssertionError(f"{n}: negative lock count")
            child_locks = sum(c.lock_ref for c in n.children.values())
            if n.lock_ref < child_locks:
                raise AssertionError(f"{n}: lock_ref {n.lock_ref} < children's {child_locks}")
            if n.depth != n.parent.depth + 1 or n.parent.children.get(n.key) is not n:
                raise AssertionError(f"{n}: broken parent link")
            if n.tree is not self:
                raise AssertionError(f"{n}: names another tree")
            hot = sum(c.full is not None or c.dev_kids > 0 for c in n.children.values())
            if n.dev_kids != hot:
                raise AssertionError(f"{n}: dev_kids {n.dev_kids}, but {hot} children hold device pages")
