"""The one place that knows both requests and the cache.

A request's pages are either borrowed from the radix tree (its matched prefix, and
whatever it inserted: the tree owns those) or its own (it frees them). Page ``j`` holds
tokens ``jP .. jP+P-1``::

    pages      | 0 | 1 | 2 | 3 | 4 | 5 | 6 |
    owner      | tree (matched/inserted)   | own (decode) ...
    sliding KV   x   x   x  [ window ...   ]      x: tombstoned by the tree, or freed

Prompt pages go into the tree at every prefill chunk boundary, before anything can slide
out of the window, so the window that ends at the prompt's usable end survives for the
next identical prompt. A running request frees only the out-of-window SWA pages it owns
and pins (``swa_lock``) only the tree nodes inside its current window.
"""

from __future__ import annotations

import time

from hicache_jax.cache.prefix_cache import Match, PrefixCache
from hicache_jax.cache.radix import path_to
from hicache_jax.kinds import PAGED, CacheKind
from hicache_jax.request import Req, ReqCache
from hicache_jax.tiers import Tier, zero_counts


class CacheAdapter:
    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.rules = cache.rules
        self.P = cache.rules.page_size
        self.kinds = tuple(k for k in (CacheKind.FULL, CacheKind.SWA) if k in cache.pools)
        self.has_state = CacheKind.STATE in cache.pools

    # ---- admission ---------------------------------------------------------------------
    def match(self, req: Req) -> Match:
        lsl = req.logprob_start_len if req.return_logprob else -1
        return self.cache.match(req.fill_ids, len(req.fill_ids), lsl, salt=req.cache_salt)

    def admit(self, req: Req, match: Match, first_end: int) -> bool:
        """Take the matched prefix (loading host-only parts to the device) and the
        resources for tokens up to ``first_end``; all or nothing."""
        slot = None
        if self.has_state:
            slot = self.cache.alloc(CacheKind.STATE, 1)
            if slot is None:
                return False
        self.cache.lock(match.last)
        req.cache.last_node = match.last
        req.num_computed = match.end
        self._relock_window(req, match.nodes)  # pin the window before loads allocate
        t0, loads = time.monotonic(), bool(match.loads)
        if loads and not self.cache.load(match):
            if slot:
                self.cache.pools[CacheKind.STATE].free(slot)
            self.release(req)
            return False
        if loads:
            req.timing["l2_load_s"] = req.timing.get("l2_load_s", 0.0) + time.monotonic() - t0
        n, held = len(match.nodes), req.cache
        for kind in PAGED:
            held.pages[kind] = [getattr(x, kind) for x in match.nodes]
            held.own[kind] = [False] * n
        if CacheKind.SWA in self.cache.pools:
            self._drop_swa_before(req, self._window_start(req))
        self._count_cached(req, match)
        held.num_inserted_pages = n
        if self.has_state:
            held.state_slot = slot[0]
            held.restore_from = match.last.state if n else None
        if not self.ensure_pages(req, first_end):
            req.loaded_tiers = self._origin_tiers(req, match)  # the next attempt finds them on device
            self.release(req)
            return False
        return True

    def _count_cached(self, req: Req, match: Match) -> None:
        """``cached_tokens`` (and per tier): the prompt served from the cache. After a
        retraction only pages beyond what the request had computed itself count, added
        to what its first admission found (as SGLang counts). A page an earlier, refused
        admission brought to the device counts with the tier it came from."""
        tiers = self._origin_tiers(req, match)
        if not req.retractions:
            req.cached_tokens, req.cached_details = 0, zero_counts()
        for tier in tiers[req.computed_before // self.P :]:
            req.cached_tokens += self.P
            req.cached_details[tier] += self.P

    @staticmethod
    def _origin_tiers(req: Req, match: Match) -> list[str]:
        """Each matched page's tier before this request's refused admissions loaded it."""
        came = req.loaded_tiers
        return [t if t != Tier.DEVICE or j >= len(came) else came[j] for j, t in enumerate(match.page_tiers)]

    def ensure_pages(self, req: Req, end: int) -> bool:
        """Own pages for every page up to token ``end``; all or nothing."""
        held = req.cache
        need = -(-end // self.P) - held.num_pages
        if need <= 0:
            return True
        got = {}
        for kind in self.kinds:
            got[kind] = self.cache.alloc(kind, need)
            if got[kind] is None:
                for k, pages in got.items():
                    if pages:
                        self.cache.pools[k].free(pages)
                return False
        for kind in PAGED:
            held.pages[kind] += got.get(kind, [None] * need)
            held.own[kind] += [kind in got] * need
        return True

    def snapshot_slot(self, req: Req, pages: int) -> int | None:
        """A slot for a state snapshot at ``pages`` pages (None: no room, skip it)."""
        if not self.cache.enabled:
            return None
        held = req.cache
        decode = [k for k in held.snapshots if k > held.num_inserted_pages]
        if decode:  # during decode keep one rolling snapshot: the latest page boundary
            slot = held.snapshots.pop(decode[0])
        else:
            got = self.cache.alloc(CacheKind.STATE, 1)
            if got is None:
                return None
            slot = got[0]
        held.snapshots[pages] = slot
        return slot

    # ---- after a step -------------------------------------------------------------------
    def after_step(self, req: Req, insert: bool) -> None:
        if insert:
            self.insert(req, req.num_computed // self.P)
        self._slide_window(req)

    def insert(self, req: Req, num_pages: int) -> None:
        held = req.cache
        num_pages = min(num_pages, held.num_pages)
        if not self.cache.enabled or num_pages <= held.num_inserted_pages:
            return
        pages = {
            k: [p if own else None for p, own in zip(held.pages[k], held.own[k])]
            for k in PAGED
            if k in self.cache.pools
        }
        if self.has_state:
            pages[CacheKind.STATE] = [held.snapshots.get(j + 1) for j in range(num_pages)]
        node, taken = self.cache.insert(req.fill_ids, held.last_node, num_pages, pages, salt=req.cache_salt)
        for kind in PAGED:
            for j in taken.get(kind, ()):
                held.own[kind][j] = False
        if CacheKind.FULL in pages:
            self._adopt_tree_pages(req, path_to(node), num_pages, taken[CacheKind.FULL])
        for j in [k for k in held.snapshots if k <= num_pages]:
            slot = held.snapshots.pop(j)
            if j - 1 not in taken.get(CacheKind.STATE, ()):
                self.cache.pools[CacheKind.STATE].free([slot])  # the tree had one already
        self.cache.relock(held.last_node, node)  # node is at or below it: insert started there
        held.last_node = node
        held.num_inserted_pages = num_pages
        if CacheKind.SWA in self.cache.pools:
            self._relock_window(req, path_to(node))

    def _adopt_tree_pages(self, req: Req, path: list, num_pages: int, taken: set[int]) -> None:
        """Full pages the tree already held (another request computed the same tokens first)
        replace the request's own copies, which are freed: the request locks those tree
        pages anyway, and holding both made a request that fits the pool alone run out of
        pages (a 176-token prompt computed twice, on a 24-page pool, held 4 duplicates)."""
        pages, own = req.cache.pages[CacheKind.FULL], req.cache.own[CacheKind.FULL]
        for j in range(num_pages):
            if own[j] and j not in taken and path[j].full is not None:
                self.cache.pools[CacheKind.FULL].free([pages[j]])
                pages[j], own[j] = path[j].full, False

    def _relock_window(self, req: Req, path: list) -> None:
        """Pin the tree nodes inside the request's current window, and only those."""
        if CacheKind.SWA not in self.cache.pools:
            return
        self.cache.swa_unlock(req.cache.swa_locked)
        first = self._window_start(req)
        req.cache.swa_locked = path[first:]
        self.cache.swa_lock(req.cache.swa_locked)
        self._drop_swa_before(req, first)

    def _window_start(self, req: Req) -> int:
        """First page to keep: the window of the last page boundary, not of the current
        position, so the computed sequence stays matchable up to that boundary."""
        aligned = req.num_computed // self.P * self.P
        return self.rules.swa_pages_needed(aligned).start if aligned else 0

    def _slide_window(self, req: Req) -> None:
        if CacheKind.SWA not in self.cache.pools:
            return
        first = self._window_start(req)
        locked = req.cache.swa_locked
        keep = [n for n in locked if n.depth - 1 >= first]
        self.cache.swa_unlock([n for n in locked if n.depth - 1 < first])
        req.cache.swa_locked = keep
        self._drop_swa_before(req, first)

    def _drop_swa_before(self, req: Req, first: int) -> None:
        """Out-of-window pages: free the ones the request owns, forget the borrowed ones."""
        pages, own = req.cache.pages[CacheKind.SWA], req.cache.own[CacheKind.SWA]
        for j in range(min(first, len(pages))):
            if pages[j] is not None:
                if own[j]:
                    self.cache.pools[CacheKind.SWA].free([pages[j]])
                    own[j] = False
                pages[j] = None

    # ---- leaving ------------------------------------------------------------------------
    def finish(self, req: Req) -> None:
        """Give the computed sequence to the tree, then release what is left."""
        self.insert(req, req.num_computed // self.P)
        self.release(req)

    def release(self, req: Req) -> None:
        held = req.cache
        for kind in PAGED:
            mine = held.owned(kind)
            if mine:
                self.cache.pools[kind].free(mine)
        if self.has_state:
            slots = list(held.snapshots.values()) + ([held.state_slot] if held.state_slot is not None else [])
            self.cache.pools[CacheKind.STATE].free(slots)
        self.cache.swa_unlock(held.swa_locked)
        self.cache.unlock(held.last_node)
        req.cache = ReqCache()
        req.num_computed = 0

    def describe_pools(self) -> str:
        return ", ".join(f"{k}: {p.num_free}/{p.size} free" for k, p in self.cache.pools.items())

    def held(self, reqs) -> dict[str, list[int]]:
        """Indices the given (running) requests own, for integrity checks."""
        out: dict[str, list[int]] = {k: [] for k in self.cache.pools}
        for r in reqs:
            for kind in PAGED:
                if kind in out:
                    out[kind] += r.cache.owned(kind)
            if self.has_state:
                out[CacheKind.STATE] += list(r.cache.snapshots.values())
                if r.cache.state_slot is not None:
                    out[CacheKind.STATE].append(r.cache.state_slot)
        return out
