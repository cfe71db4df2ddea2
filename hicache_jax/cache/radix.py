"""Page-granular radix tree of cached prefixes.

One node per page of ``page_size`` tokens; a node's key is that page's token ids, so the
path from the root spells a prefix. A node holds, per cache kind, what the cache keeps for
its page: ``dev[kind]`` is a device index, ``host[kind]`` a host (L2) row; a kind absent
from the dict is not held there. What each kind must hold follows its retention rule
(``hicache_jax/kinds.py``), never its name:

- ``EVERY`` (full attention): the page's entry;
- ``WINDOW`` (sliding window): the page's entry, or nothing on a node that still has other
  data: a *tombstone*, which a match may pass through but never end right after;
- ``SNAPSHOT`` (recurrent state): an entry taken at the end of the page.

A node whose device data was evicted but whose host copy remains stays in the tree; a match
may use it, and the engine loads it back to the device.

``lock_ref`` counts running requests whose prefix ends at or below the node; a locked node
is never evicted and keeps its every-page and snapshot entries. ``window_lock`` counts
running requests whose window covers the node: only those pin its window entries, so a long
prompt's older window pages become evictable while the request still runs. The tree holds
indices only; pools free them.

Every operation here costs the path it walks, never the size of the tree: eviction order
is kept by the prefix cache's LRU queues (``eviction_order.py``, ``lru.py``), which use
``inq`` and ``dev_kids``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from hicache_jax.kinds import Retention, retention

_clock = itertools.count(1)


class Node:
    __slots__ = (
        "key",
        "parent",
        "children",
        "dev",
        "host",
        "lock_ref",
        "window_lock",
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
        self.dev: dict[str, int] = {}  # cache kind -> device index
        self.host: dict[str, int] = {}  # cache kind -> host row
        self.hit_count = 0
        self.hash: bytes | None = None  # chained page hash (L3 key), computed on demand
        self.from_storage = False  # its host data came from L3 and was not used yet
        self.lock_ref = 0
        self.window_lock = 0
        self.last_access = next(_clock)
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root
        self.inq = 0  # bit per LRU queue that holds an entry for it (lru.LruQueue)
        # children whose subtree (child included) holds a device entry of an EVERY kind
        self.dev_kids = 0

    @property
    def is_root(self) -> bool:
        return self.depth == 0

    @property
    def empty(self) -> bool:
        return self.device_empty and self.host_empty

    @property
    def device_empty(self) -> bool:
        return not self.dev

    @property
    def host_empty(self) -> bool:
        return not self.host

    @property
    def on_device(self) -> bool:
        """It holds a device entry of a kind every page needs (what ``dev_kids`` counts)."""
        return any(retention(k) is Retention.EVERY for k in self.dev)

    def tree_remove(self) -> None:
        """Unlink an unlocked leaf from its parent."""
        if self.children or self.parent is None or self.lock_ref or self.window_lock:
            raise RuntimeError(f"cannot remove {self}: not an unlocked leaf")
        del self.parent.children[self.key]
        self.parent = None

    def has(self, kind: str) -> bool:
        """The kind's data is in some tier."""
        return kind in self.dev or kind in self.host

    def __repr__(self) -> str:
        host = f", host={self.host}" if self.host else ""
        return (
            f"Node(depth={self.depth}, dev={self.dev}{host}, "
            f"lock={self.lock_ref}, window_lock={self.window_lock})"
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
            if n.lock_ref < 0 or n.window_lock < 0:
                raise AssertionError(f"{n}: negative lock count")
            child_locks = sum(c.lock_ref for c in n.children.values())
            if n.lock_ref < child_locks:
                raise AssertionError(f"{n}: lock_ref {n.lock_ref} < children's {child_locks}")
            if n.depth != n.parent.depth + 1 or n.parent.children.get(n.key) is not n:
                raise AssertionError(f"{n}: broken parent link")
            if n.tree is not self:
                raise AssertionError(f"{n}: names another tree")
            hot = sum(c.on_device or c.dev_kids > 0 for c in n.children.values())
            if n.dev_kids != hot:
                raise AssertionError(f"{n}: dev_kids {n.dev_kids}, but {hot} children hold device pages")
