"""The one place that knows both requests and the cache.

A request's pages are either borrowed from the radix tree (its matched prefix, and
whatever it inserted: the tree owns those) or its own (it frees them). Page ``j`` holds
tokens ``jP .. jP+P-1``::

    pages      | 0 | 1 | 2 | 3 | 4 | 5 | 6 |
    owner      | tree (matched/inserted)   | own (decode) ...
    window kind  x   x   x  [ window ...   ]      x: tombstoned by the tree, or freed

Every paged cache kind (``PrefixRules.paged``) gets a page per page of the sequence; the
kinds a window keeps (sliding-window KV) drop the pages behind it; the snapshot kind
(recurrent state) has a working slot and snapshots at page boundaries. The adapter reads
these retention rules (and ``kinds.PAGE_STATE``) and never names a cache kind.

Prompt pages go into the tree at every prefill chunk boundary, before anything can slide
out of the window, so the window that ends at the prompt's usable end survives for the
next identical prompt. A running request frees only the out-of-window pages it owns and
pins (``window_lock``) only the tree nodes inside its current window.
"""

from __future__ import annotations

import time

from hicache_jax.cache.prefix_cache import Match, PrefixCache
from hicache_jax.cache.radix import path_to
from hicache_jax.kinds import PAGE_STATE
from hicache_jax.request import Req, ReqCache
from hicache_jax.tiers import Tier, zero_counts


class CacheAdapter:
    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.rules = cache.rules
        self.P = cache.rules.page_size
        self.kinds = tuple(k for k in self.rules.paged if k in cache.pools)  # paged kinds
        self.windowed = tuple(k for k in self.rules.windowed if k in cache.pools)
        self.snapshot = self.rules.snapshot if self.rules.snapshot in cache.pools else None
        self.page_states = tuple(k for k in self.kinds if k in PAGE_STATE)

    @property
    def has_state(self) -> bool:
        """The model keeps a snapshot kind (recurrent state)."""
        return self.snapshot is not None

    @property
    def trails(self) -> bool:
        """A verify step keeps a state per fed token (recurrent slots, page-state pages):
        its draft stays short of the next page boundary (``scheduler/drafts.py``)."""
        return self.has_state or bool(self.page_states)

    # ---- admission ---------------------------------------------------------------------
    def match(self, req: Req) -> Match:
        lsl = req.logprob_start_len if req.return_logprob else -1
        return self.cache.match(req.fill_ids, len(req.fill_ids), lsl, salt=req.cache_salt)

    def admit(self, req: Req, match: Match, first_end: int) -> bool:
        """Take the matched prefix (loading host-only parts to the device) and the
        resources for tokens up to ``first_end``; all or nothing."""
        slot = None
        if self.has_state:
            slot = self.cache.alloc(self.snapshot, 1)
            if slot is None:
                return False
        self.cache.lock(match.last)
        req.cache.last_node = match.last
        req.num_computed = match.end
        self._relock_window(req, match.nodes)  # pin the window before loads allocate
        t0, loads = time.monotonic(), bool(match.loads)
        if loads and not self.cache.load(match):
            if slot:
                self.cache.pools[self.snapshot].free(slot)
            self.release(req)
            return False
        if loads:
            req.timing["l2_load_s"] = req.timing.get("l2_load_s", 0.0) + time.monotonic() - t0
        n, held = len(match.nodes), req.cache
        for kind in self.kinds:
            held.pages[kind] = [x.dev.get(kind) for x in match.nodes]
            held.own[kind] = [False] * n
        self._drop_window_before(req, self._window_start(req))
        self._count_cached(req, match)
        held.num_inserted_pages = n
        if self.has_state:
            held.state_slot = slot[0]
            held.restore_from = match.last.dev.get(self.snapshot) if n else None
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
        for kind in self.kinds:
            held.pages.setdefault(kind, []).extend(got[kind])
            held.own.setdefault(kind, []).extend([True] * need)
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
            got = self.cache.alloc(self.snapshot, 1)
            if got is None:
                return None
            slot = got[0]
        held.snapshots[pages] = slot
        return slot

    def trail_slots(self, req: Req, n: int) -> list[int] | None:
        """``n`` scratch state slots, and ``n`` scratch pages of each page-state kind, for a
        verify step's states after each fed token but the last (``ReqCache.trail``,
        ``ReqCache.trail_pages``); all or nothing (None: no room, feed no draft)."""
        got: dict = {}
        for kind in ((self.snapshot,) if self.has_state else ()) + self.page_states:
            got[kind] = self.cache.alloc(kind, n) if n else []
            if got[kind] is None:
                for k, idx in got.items():
                    if idx:
                        self.cache.pools[k].free(idx)
                return None
        req.cache.trail = list(got.pop(self.snapshot, []))
        req.cache.trail_pages = got
        return req.cache.trail

    # ---- after a step -------------------------------------------------------------------
    def after_verify(self, req: Req, accepted: int) -> None:
        """A verify step accepted ``accepted`` draft tokens: the state after the last
        accepted one becomes the working state (a slot swap: no copy, no re-run), and the
        other scratch slots go back. All accepted: the working slot already holds it. A
        page-state kind alike: the accepted scratch page becomes the current page's (whose
        row the step wrote after its last fed token), the page the request owns (a draft
        never completes a page, so the tree has none of it)."""
        held = req.cache
        if held.trail:
            back = list(held.trail)
            if accepted < len(back):
                back[accepted], held.state_slot = held.state_slot, back[accepted]
            held.trail = []
            self.cache.pools[self.snapshot].free(back)
        page = (req.num_computed - 1) // self.P  # the last accepted token's
        for kind, back in held.trail_pages.items():
            back = list(back)
            if accepted < len(back):
                if not held.own[kind][page]:
                    raise RuntimeError(
                        f"request {req.rid}: a verify step wrote {kind} page {page}, not its own"
                    )
                back[accepted], held.pages[kind][page] = held.pages[kind][page], back[accepted]
            self.cache.pools[kind].free(back)
        held.trail_pages = {}

    def after_step(self, req: Req, insert: bool) -> None:
        if insert:
            self.insert(req, req.num_computed // self.P)
        self._slide_window(req)

    def insert(self, req: Req, num_pages: int) -> None:
        held = req.cache
        num_pages = min(num_pages, held.num_pages)
        if not self.cache.enabled or num_pages <= held.num_inserted_pages:
            return
        pages = {k: [p if own else None for p, own in zip(held.pages[k], held.own[k])] for k in self.kinds}
        if self.has_state:
            pages[self.snapshot] = [held.snapshots.get(j + 1) for j in range(num_pages)]
        node, taken = self.cache.insert(req.fill_ids, held.last_node, num_pages, pages, salt=req.cache_salt)
        for kind in self.kinds:
            for j in taken.get(kind, ()):
                held.own[kind][j] = False
        path = path_to(node)
        for kind in self.rules.every:
            if kind in pages:
                self._adopt_tree_pages(req, kind, path, num_pages, taken[kind])
        for j in [k for k in held.snapshots if k <= num_pages]:
            slot = held.snapshots.pop(j)
            if j - 1 not in taken.get(self.snapshot, ()):
                self.cache.pools[self.snapshot].free([slot])  # the tree had one already
        self.cache.relock(held.last_node, node)  # node is at or below it: insert started there
        held.last_node = node
        held.num_inserted_pages = num_pages
        self._relock_window(req, path)

    def _adopt_tree_pages(self, req: Req, kind: str, path: list, num_pages: int, taken: set[int]) -> None:
        """Pages of an every-page kind the tree already held (another request computed the
        same tokens first) replace the request's own copies, which are freed: the request
        locks those tree pages anyway, and holding both made a request that fits the pool
        alone run out of pages (a 176-token prompt computed twice, on a 24-page pool, held 4
        duplicates)."""
        pages, own = req.cache.pages[kind], req.cache.own[kind]
        for j in range(num_pages):
            if own[j] and j not in taken and kind in path[j].dev:
                self.cache.pools[kind].free([pages[j]])
                pages[j], own[j] = path[j].dev[kind], False

    def _relock_window(self, req: Req, path: list) -> None:
        """Pin the tree nodes inside the request's current window, and only those."""
        if not self.windowed:
            return
        self.cache.window_unlock(req.cache.window_locked)
        first = self._window_start(req)
        req.cache.window_locked = path[first:]
        self.cache.window_lock(req.cache.window_locked)
        self._drop_window_before(req, first)

    def _window_start(self, req: Req) -> int:
        """First page to keep: the window of the last page boundary, not of the current
        position, so the computed sequence stays matchable up to that boundary."""
        aligned = req.num_computed // self.P * self.P
        return self.rules.window_pages(aligned).start if aligned else 0

    def _slide_window(self, req: Req) -> None:
        if not self.windowed:
            return
        first = self._window_start(req)
        locked = req.cache.window_locked
        keep = [n for n in locked if n.depth - 1 >= first]
        self.cache.window_unlock([n for n in locked if n.depth - 1 < first])
        req.cache.window_locked = keep
        self._drop_window_before(req, first)

    def _drop_window_before(self, req: Req, first: int) -> None:
        """Out-of-window pages: free the ones the request owns, forget the borrowed ones."""
        for kind in self.windowed:
            pages, own = req.cache.pages.get(kind, []), req.cache.own.get(kind, [])
            for j in range(min(first, len(pages))):
                if pages[j] is not None:
                    if own[j]:
                        self.cache.pools[kind].free([pages[j]])
                        own[j] = False
                    pages[j] = None

    # ---- leaving ------------------------------------------------------------------------
    def finish(self, req: Req) -> None:
        """Give the computed sequence to the tree, then release what is left."""
        self.insert(req, req.num_computed // self.P)
        self.release(req)

    def release(self, req: Req) -> None:
        held = req.cache
        for kind in self.kinds:
            mine = held.owned(kind)
            if mine:
                self.cache.pools[kind].free(mine)
        if self.has_state:
            slots = list(held.snapshots.values()) + held.trail
            slots += [held.state_slot] if held.state_slot is not None else []
            self.cache.pools[self.snapshot].free(slots)
        for kind, pages in held.trail_pages.items():
            self.cache.pools[kind].free(pages)
        self.cache.window_unlock(held.window_locked)
        self.cache.unlock(held.last_node)
        req.cache = ReqCache()
        req.num_computed = 0

    def describe_pools(self) -> str:
        return ", ".join(f"{k}: {p.num_free}/{p.size} free" for k, p in self.cache.pools.items())

    def held(self, reqs) -> dict[str, list[int]]:
        """Indices the given (running) requests own, for integrity checks."""
        out: dict[str, list[int]] = {k: [] for k in self.cache.pools}
        for r in reqs:
            for kind in self.kinds:
                out[kind] += r.cache.owned(kind) + r.cache.trail_pages.get(kind, [])
            if self.has_state:
                out[self.snapshot] += list(r.cache.snapshots.values()) + r.cache.trail
                if r.cache.state_slot is not None:
                    out[self.snapshot].append(r.cache.state_slot)
        return out
