"""The prefix cache over device (L1) and, optionally, host (L2) memory, behind a
request-free API: one radix tree per ``cache_salt``, matching with tier accounting, L2 ->
L1 loads, inserts from L1 and from L3, locks, maintenance and integrity checks.

Its parts are modules of their own, composed here and reached only through this facade;
none of them imports it:

- ``holdings.py`` (``Holdings``): the trees, the pools and what each node holds; every
  change to a node's data goes through its setters, which keep the rest current;
- ``eviction_order.py`` (``EvictionOrder``): each pool's eviction rule and LRU order;
- ``eviction.py`` (``Eviction``): a short pool frees the order's victims;
- ``write_policy.py`` (``WritePolicy``): which nodes wait to be copied to the host;
- ``backups.py`` (``Backups``): the copies, and the ``on_backup`` hook that queues the L3 write;
- ``integrity.py``: the checks.

Only maintenance (flush, drop_device, check_integrity) walks everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from hicache_jax.cache import integrity
from hicache_jax.cache.backups import Backups
from hicache_jax.cache.eviction import Eviction
from hicache_jax.cache.eviction_order import EvictionOrder
from hicache_jax.cache.holdings import Holdings
from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.cache.radix import Node, RadixTree
from hicache_jax.cache.write_policy import WritePolicy
from hicache_jax.metric_kinds import Metrics
from hicache_jax.tiers import Tier, zero_counts


@dataclasses.dataclass
class Match:
    nodes: list[Node]  # the reused path, root excluded
    end: int  # tokens: len(nodes) * page_size
    loads: list[tuple[str, Node]] = dataclasses.field(default_factory=list)  # host -> device
    tiers: dict = dataclasses.field(default_factory=zero_counts)
    page_tiers: list[str] = dataclasses.field(default_factory=list)  # each page's tier, in order

    @property
    def last(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None


class PrefixCache:
    def __init__(
        self,
        rules: PrefixRules,
        pools: dict[str, IndexPool],
        *,
        enabled: bool = True,
        host: dict[str, HostPool] | None = None,
        transfer=None,  # .read(kind, device_idx) -> arrays, .write(kind, device_idx, arrays)
        write_policy: str = "write_through",
    ):
        self.rules = rules
        self.enabled = enabled
        self.transfer = transfer
        host = host or {}
        self.counters = Metrics().counters({"host_loads": 0, "host_backups": 0, "backup_skipped": 0})
        self.write_policy = WritePolicy(write_policy, host)
        order = EvictionOrder(pools, host, write_back=write_policy == "write_back")
        self.held = Holdings(rules.page_size, pools, host, order, self.write_policy)
        self.eviction = Eviction(self.held)
        host_alloc = self.eviction.host_alloc
        self.backups = Backups(self.held, self.write_policy, host_alloc, transfer, self.counters)
        if write_policy == "write_back":  # the device's eviction copies its victim first
            self.eviction.write_back = self.backups.backup

    # ---- what it holds (``holdings.py``) -------------------------------------------------------
    @property
    def pools(self) -> dict[str, IndexPool]:
        return self.held.pools

    @property
    def host(self) -> dict[str, HostPool]:
        return self.held.host

    @property
    def trees(self) -> dict[str | None, RadixTree]:
        """One tree per cache_salt: tenants never share pages."""
        return self.held.trees

    @property
    def storage_rows(self) -> int:
        """Host rows of nodes L3 filled that no match used yet."""
        return self.held.storage_rows

    def tree(self, salt: str | None = None) -> RadixTree:
        return self.held.tree(salt)

    def walk(self, tokens: Sequence[int], max_pages: int, salt: str | None = None) -> list[Node]:
        """The cached path along ``tokens`` (lookups never create a tree)."""
        tree = self.trees.get(salt)
        return tree.walk(tokens, max_pages) if tree is not None else []

    def salt_of(self, node: Node) -> str | None:
        return node.tree.salt

    def nodes(self) -> Iterator[Node]:
        return self.held.nodes()

    # ---- lookup -------------------------------------------------------------------------
    def availability(self, path: Sequence[Node]) -> dict[str, list[bool]]:
        """Per cache kind the model keeps, whether each node of ``path`` holds it in any tier."""
        return {k: [n.has(k) for n in path] for k in self.rules.kinds}

    def match(
        self, tokens: Sequence[int], input_len: int, logprob_start_len: int = -1, salt: str | None = None
    ) -> Match:
        """The longest usable prefix in any tier (``usable_prefix_end``), and the host ->
        device loads it needs."""
        if not self.enabled:
            return Match([], 0)
        P = self.rules.page_size
        path = self.walk(tokens, self.rules.max_end(input_len, logprob_start_len) // P, salt)
        end = usable_prefix_end(self.rules, input_len, logprob_start_len, self.availability(path))
        nodes = path[: end // P]
        RadixTree.touch(nodes)
        match = Match(nodes, end)
        needed = {k: set(self.rules.pages_needed(k, end)) for k in self.rules.kinds if k in self.pools}
        page_tier = []
        for j, node in enumerate(nodes):
            need = [k for k, pages in needed.items() if j in pages]
            missing = [k for k in need if k not in node.dev]
            match.loads += [(k, node) for k in missing]
            if not need:
                tier = None
            elif not missing:
                tier = Tier.DEVICE
            else:
                tier = Tier.STORAGE if node.from_storage else Tier.HOST
            page_tier.append(tier)
            node.hit_count += 1
            self.write_policy.hit(node)
        # Pages that need no data (before a sliding window) count with the hit's deepest tier.
        fallback = next((t for t in (Tier.STORAGE, Tier.HOST) if t in page_tier), Tier.DEVICE)
        match.page_tiers = [tier or fallback for tier in page_tier]
        for tier in match.page_tiers:
            match.tiers[tier] += P
        return match

    def load(self, match: Match) -> bool:
        """Bring the match's host-only data to the device (all or nothing). The caller has
        locked the path (and the window) so allocation cannot evict it."""
        by_kind: dict[str, list[Node]] = {}
        for kind, node in match.loads:
            by_kind.setdefault(kind, []).append(node)
        got: dict[str, list[int]] = {}
        for kind, nodes in by_kind.items():
            idx = self.alloc(kind, len(nodes))
            if idx is None:
                for k, i in got.items():
                    self.pools[k].free(i)
                return False
            got[kind] = idx
        for kind, nodes in by_kind.items():
            rows = [n.host[kind] for n in nodes]
            self.transfer.write(kind, got[kind], self.host[kind].read(rows))
            for n, i in zip(nodes, got[kind]):
                self.held.set_device(n, kind, i)
            self.counters["host_loads"] += len(nodes)
        for n in match.nodes:
            self.held.set_from_storage(n, False)
        match.loads = []
        return True

    # ---- allocation with eviction, and host backups (eviction.py, backups.py) --------------
    def alloc(self, kind: str, n: int) -> list[int] | None:
        """``n`` device indices of ``kind``, evicting unlocked data for them; None: no room."""
        return self.eviction.alloc(kind, n)

    def host_alloc(self, kind: str, n: int) -> list[int] | None:
        """``n`` host rows of ``kind``, evicting host data for them; None: no room."""
        return self.eviction.host_alloc(kind, n)

    def evict(self, kind: str, n: int) -> int:
        """Free at least ``n`` device indices of ``kind`` if unlocked nodes allow."""
        return self.eviction.evict(kind, n)

    def evict_host(self, kind: str, n: int) -> int:
        """Free at least ``n`` host rows of ``kind`` if unlocked nodes allow."""
        return self.eviction.evict_host(kind, n)

    def backup_pending(self, everything: bool = False) -> int:
        """Copy what the write policy queued to the host (``everything``: a write-back flush)."""
        return self.backups.backup_pending(everything)

    @property
    def on_backup(self) -> Callable[[Node, tuple[str, ...]], None] | None:
        """Called with each node and the kinds a backup copied to the host."""
        return self.backups.on_backup

    @on_backup.setter
    def on_backup(self, hook: Callable[[Node, tuple[str, ...]], None] | None) -> None:
        self.backups.on_backup = hook

    # ---- insertion ------------------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        start: Node | None,
        num_pages: int,
        pages: dict[str, list[int | None]],
        salt: str | None = None,
    ) -> tuple[Node, dict[str, set[int]]]:
        """Add pages ``start.depth .. num_pages-1`` of ``tokens`` below ``start`` (default the
        salt's root). ``pages[kind][j]`` is the caller's device index for page ``j`` (None:
        not held). Returns the last node and, per kind, the page numbers whose index the
        tree took: those now belong to the tree; the caller keeps (and frees) the rest."""
        tree = self.tree(salt)
        node = start or tree.root
        taken: dict[str, set[int]] = {k: set() for k in pages}
        path = []
        for j in range(node.depth, num_pages):
            key = tree.page_key(tokens, j)
            child = node.children.get(key) or tree.add_child(node, key)
            for kind, idx in pages.items():
                if idx[j] is not None and kind not in child.dev:
                    self.held.set_device(child, kind, idx[j])
                    taken[kind].add(j)
                    self.write_policy.inserted(child)
            path.append(child)
            node = child
        RadixTree.touch(path)
        return node, taken

    def insert_host(
        self,
        tokens: Sequence[int],
        salt: str | None,
        data: dict[int, dict[str, dict[str, np.ndarray]]],
        hashes: Sequence[bytes],
        num_pages: int,
    ) -> int:
        """Put pages fetched from L3 into the host tier: ``data[j][kind]`` is page ``j``'s
        arrays. Returns the number of pages stored (stops when the host is full)."""
        tree = self.tree(salt)
        node = tree.root
        stored = 0
        path = []
        for j in range(num_pages):
            key = tree.page_key(tokens, j)
            node = node.children.get(key) or tree.add_child(node, key)
            node.hash = hashes[j]
            for kind, arrays in data.get(j, {}).items():
                if kind not in self.host or node.has(kind):
                    continue
                row = self.host_alloc(kind, 1)
                if row is None:
                    self.held.prune(node)
                    return stored
                self.host[kind].write(row, {k: v[None] for k, v in arrays.items()})
                self.held.set_host(node, kind, row[0])
                self.held.set_from_storage(node, True)
                stored += 1
            path.append(node)
        RadixTree.touch(path)
        return stored

    def lock(self, node: Node | None) -> None:
        if node is not None:
            RadixTree.lock(node)

    def unlock(self, node: Node | None) -> None:
        if node is not None:
            for n in RadixTree.unlock(node):
                self.held.order.offer(n)
            self.held.prune(node)

    def relock(self, old: Node | None, new: Node) -> None:
        """Move a lock from ``old`` down to its descendant ``new`` (lock(new), unlock(old)
        in the cost of the pages between them)."""
        RadixTree.lock(new, above=old)

    def window_lock(self, nodes) -> None:
        """Pin the window kinds' entries of ``nodes`` (a running request's window covers them)."""
        for n in nodes:
            n.window_lock += 1

    def window_unlock(self, nodes) -> None:
        for n in nodes:
            if n.window_lock <= 0:
                raise RuntimeError(f"window-unlocking {n} below zero")
            n.window_lock -= 1
            if not n.window_lock:
                for kind in self.rules.windowed:
                    if kind in n.dev:
                        self.held.order.offer_device(kind, n)

    # ---- maintenance ------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every unlocked node, device and host (everything when no request runs)."""
        self.held.flush()

    def drop_device(self) -> None:
        """Forget every device index (the device cache was lost): device pools reset, nodes
        keep their host copies, nodes left with nothing are pruned. Nothing may be locked."""
        self.held.drop_device()

    def tree_indices(self) -> dict[str, list[int]]:
        """Every device index the trees hold, by pool."""
        return {k: v for k, v in integrity.indices(self.held).items() if k in self.pools}

    def check_integrity(self, held_outside: dict[str, list[int]] | None = None) -> None:
        """Pools consistent, trees consistent, and every used index owned exactly once: by
        a tree or by ``held_outside`` (the running requests); see ``integrity.py``."""
        integrity.check_integrity(self.held, held_outside)

    # ---- the pools, as the engine asks about them -------------------------------------------
    def sequence_capacity(self) -> int:
        """The most tokens one sequence can hold on the device (a longer prompt could never
        run): the smallest page pool; window-only models hold a window, not the sequence."""
        capacity = min(p.size for k, p in self.pools.items() if k in self.rules.paged) * self.rules.page_size
        if not self.rules.every and not self.rules.snapshot:
            capacity = 1 << 62
        return capacity

    def has_free_pages(self, n: int) -> bool:
        """Whether every page pool (not the snapshot slots) has ``n`` free pages: ``n`` running
        sequences can each take one more page without evicting anything."""
        return all(p.num_free >= n for k, p in self.pools.items() if k in self.rules.paged)

    def metrics(self) -> Metrics:
        """Pool use (gauges) and the cache's counters."""
        out = Metrics()
        for kind, pool in self.pools.items():
            out.gauges({f"pool_{kind}_used": pool.num_used, f"pool_{kind}_size": pool.size})
        for kind, pool in self.host.items():
            out.gauges({f"host_pool_{kind}_used": pool.index.num_used, f"host_pool_{kind}_size": pool.size})
        return out.add(self.counters)

    def pages_in_use(self) -> dict[str, int]:
        """Used pages per device and host pool (all zero once flushed and idle)."""
        out = {f"device {k}": p.num_used for k, p in self.pools.items()}
        out.update({f"host {k}": p.index.num_used for k, p in self.host.items()})
        return out
