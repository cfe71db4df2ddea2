"""What the prefix cache holds: the trees (one per ``cache_salt``), the pools, and each
node's device indices and host rows, with everything kept in step with them.

Every change to a node's data goes through the setters here (``set_device``, ``set_host``,
``set_from_storage``, ``remove_leaf``, ``remove_subtree``, ``prune``), which keep the
eviction order (``eviction_order.py``), ``dev_kids``, ``storage_rows`` and the write
policy's queue current. ``PrefixCache`` and its parts (``eviction.py``, ``backups.py``)
change nodes only through them; ``integrity.py`` checks what they kept. Only maintenance
(``flush``, ``drop_device``) walks everything.
"""

from __future__ import annotations

from collections.abc import Iterator

from hicache_jax.cache.eviction_order import EvictionOrder
from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.radix import Node, RadixTree
from hicache_jax.cache.write_policy import WritePolicy


class Holdings:
    def __init__(
        self,
        page_size: int,
        pools: dict[str, IndexPool],
        host: dict[str, HostPool],
        order: EvictionOrder,
        write_policy: WritePolicy,
    ):
        self.page_size = page_size
        self.pools = pools
        self.host = host
        self.order = order
        self.write_policy = write_policy
        self.trees: dict[str | None, RadixTree] = {}
        self.storage_rows = 0  # host rows of nodes L3 filled that no match used yet

    # ---- trees (one per cache_salt: tenants never share pages) ----------------------------
    def tree(self, salt: str | None = None) -> RadixTree:
        """The salt's tree, made on first insert. A tree that empties is dropped (see
        ``unlink``), so a stream of one-off salts never accumulates trees."""
        if salt not in self.trees:
            self.trees[salt] = RadixTree(self.page_size, salt)
        return self.trees[salt]

    def nodes(self) -> Iterator[Node]:
        for t in list(self.trees.values()):
            yield from t.nodes()

    # ---- every change to a node's data goes through these ----------------------------------
    def set_device(self, node: Node, kind: str, idx: int | None) -> None:
        """Set a device index (None: gone)."""
        was = node.on_device
        _put(node.dev, kind, idx)
        if was != node.on_device and not node.dev_kids:
            self.order.device_page_changed(node.parent, 1 if node.on_device else -1)
        self.order.offer(node)

    def set_host(self, node: Node, kind: str, row: int | None) -> None:
        """Set a host row (None: gone)."""
        if node.from_storage:
            self.storage_rows += (row is not None) - (kind in node.host)
        _put(node.host, kind, row)
        self.order.offer(node)

    def set_from_storage(self, node: Node, value: bool) -> None:
        if node.from_storage != value:
            held = len(node.host)
            self.storage_rows += held if value else -held
            node.from_storage = value

    def remove_leaf(self, node: Node) -> None:
        """Drop a leaf with everything it holds."""
        parent, was_on_device = node.parent, node.on_device
        for kind, idx in node.dev.items():
            self.pools[kind].free([idx])
        for kind, row in node.host.items():
            self.host[kind].index.free([row])
        self.storage_rows -= node.from_storage * len(node.host)
        node.dev, node.host = {}, {}
        self.unlink(node)
        if was_on_device:
            self.order.device_page_changed(parent, -1)

    def unlink(self, node: Node) -> None:
        """Take an unlocked leaf out of its tree; drop the tree if that emptied it."""
        self.write_policy.forget(node)
        parent = node.parent
        node.tree_remove()
        self.order.forget(node)
        if not parent.is_root:
            self.order.offer(parent)  # a leaf now
        elif not parent.children:
            del self.trees[parent.tree.salt]

    def remove_subtree(self, node: Node) -> None:
        """Drop an unlocked node with everything below it, in every tier."""
        stack, order = [node], []
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        for x in reversed(order):  # leaves first
            self.remove_leaf(x)

    def prune(self, node: Node) -> None:
        """Drop ``node`` and its ancestors while they hold nothing and nobody needs them."""
        while (
            not node.is_root
            and node.empty
            and not node.children
            and not node.lock_ref
            and not node.window_lock
        ):
            parent = node.parent
            self.unlink(node)
            node = parent

    # ---- maintenance ------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every unlocked node, device and host (everything when no request runs)."""
        for tree in list(self.trees.values()):
            for node in tree.post_order():  # a node's children go before it
                if not node.children and not node.lock_ref and not node.window_lock:
                    self.remove_leaf(node)
        self.write_policy.clear()
        self._rebuild()

    def drop_device(self) -> None:
        """Forget every device index (the device cache was lost): device pools reset, nodes
        keep their host copies, nodes left with nothing are pruned. Nothing may be locked."""
        for node in list(self.nodes()):
            if node.lock_ref or node.window_lock:
                raise RuntimeError(f"drop_device with {node} still locked")
            node.dev = {}
        for pool in self.pools.values():
            pool.reset()
        self.write_policy.clear()
        for tree in list(self.trees.values()):
            for node in tree.post_order():
                if node.empty and not node.children:
                    self.unlink(node)
        self._rebuild()

    def _rebuild(self) -> None:
        """Recount ``storage_rows`` and the eviction order from the trees (after a bulk
        change: flush, drop_device)."""
        self.storage_rows = 0
        everything = [n for t in self.trees.values() for n in t.post_order()]
        for n in everything:
            if n.from_storage:
                self.storage_rows += len(n.host)
        self.order.rebuild(everything)


def _put(entries: dict[str, int], kind: str, idx: int | None) -> None:
    if idx is None:
        entries.pop(kind, None)
    else:
        entries[kind] = idx
