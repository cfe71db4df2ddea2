"""Bounded L3: a size cap and a free-space floor, kept by LRU eviction shared by every server.

Every server on a store runs one `Capacity` thread (never the scheduler thread). Each tick:

  1. it writes the pages it read or wrote since the last tick as one journal object
     (journal.py): recency costs one write per tick, not one per hit;
  2. it takes or renews the evictor lease (lease.py). Only the holder goes on -- one evictor
     at a time, so two servers never both evict for the same excess;
  3. the holder folds new journal objects into its in-memory index (lru_index.py), and when
     the store is past a limit evicts least-recently-used pages down to the low watermark:

         cap:    used > max_bytes          -> evict until used <= low_watermark * max_bytes
         floor:  free < min_free_bytes     -> evict until free >= min_free_bytes / low_watermark

     A page that cannot be removed (permission, read-only, I/O error) is marked stuck, skipped
     by later passes and counted; the pass goes on with the next page, so one bad file never
     stalls eviction. Before each batch of deletes the holder checks it still holds the lease;
  4. it checkpoints the index to ``meta/index`` (every `checkpoint_s`, or a second per 20,000
     pages if longer, and on close),
     then deletes the journal objects the checkpoint holds, so a new holder starts from it.
  5. it sweeps the prefill -> decode handover markers (handover.py): one listing of
     ``meta/handover/``, reading only markers new since its last sweep, and deletes those
     older than `handover_max_age_s` and, past `handover_max_markers`, the oldest.

A write that takes the store past a limit (as this server last saw the store's size) wakes the
thread at once instead of at the next tick; the cap may be overshot by the writes of about one
tick. Readers never match past a missing page (the client stops a prefetch at the first miss,
the tier's match needs every page from the first), so evicting a page never lets a later page
of its prefix be served; within one touch the deeper pages of a prefix are evicted first.

All servers on one store should run with the same limits: the current lease holder's rule.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from hicache_jax.metric_kinds import Metrics
from hicache_jax.storage.guard import GuardConfig, StoreGuard
from hicache_jax.storage.handover import HandoverBoard
from hicache_jax.storage.journal import JOURNAL, RecencyLog, Segment, is_journal_key
from hicache_jax.storage.layout import META
from hicache_jax.storage.lease import Lease
from hicache_jax.storage.lru_index import LruIndex
from hicache_jax.storage.ratelog import RateLimitedLog
from hicache_jax.storage.stats import Counters

log = logging.getLogger(__name__)
INDEX = META + "index"
USAGE = META + "usage.json"
RECORDS = (INDEX, USAGE)  # the meta objects besides the lease and the journal


@dataclasses.dataclass(frozen=True)
class CapacityConfig:
    max_bytes: int = 0  # 0: no size cap
    min_free_bytes: int = 0  # 0: no free-space floor (file stores only)
    low_watermark: float = 0.9  # evict down to this share of the limit
    tick_s: float = 2.0  # journal flush, lease renewal and eviction check period
    lease_ttl_s: float = 30.0  # a dead evictor's lease is free after this long
    checkpoint_s: float = 60.0  # most time between index checkpoints
    delete_batch: int = 256  # pages per delete call
    timeout_s: float = 5.0  # deadline of one store call
    handover_max_markers: int = 10_000  # PD handover markers kept (the newest)
    handover_max_age_s: float = 600.0  # a handover marker older than this is swept

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.min_free_bytes < 0:
            raise ValueError("CapacityConfig: max_bytes and min_free_bytes must be >= 0")
        if not 0 < self.low_watermark <= 1:
            raise ValueError(f"CapacityConfig.low_watermark must be in (0, 1], got {self.low_watermark}")
        for name in ("tick_s", "lease_ttl_s", "checkpoint_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CapacityConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.lease_ttl_s <= 2 * self.tick_s:
            raise ValueError("CapacityConfig.lease_ttl_s must exceed two ticks (the holder renews each tick)")
        if self.delete_batch < 1:
            raise ValueError(f"CapacityConfig.delete_batch must be >= 1, got {self.delete_batch}")
        if self.handover_max_markers < 0 or not self.handover_max_age_s > 0:
            raise ValueError(
                "CapacityConfig: handover_max_markers must be >= 0 and handover_max_age_s > 0, got "
                f"{self.handover_max_markers} and {self.handover_max_age_s}"
            )

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 or self.min_free_bytes > 0


class Capacity:
    """The capacity thread of one server. `store` is read through `get_store()` at each call
    (tests swap a client's store in place)."""

    def __init__(
        self,
        get_store: Callable,
        cfg: CapacityConfig,
        *,
        free_bytes: Callable[[], int] | None = None,
        server_id: str | None = None,
        start: bool = True,
    ):
        self.cfg = cfg
        self._store = get_store
        # Injectable: tests fake the free-space probe rather than fill a disk.
        self.free_bytes = free_bytes or (lambda: self._store().free_bytes())
        self.server_id = server_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.journal = RecencyLog(self.server_id)
        self.guard = StoreGuard(GuardConfig(cfg.timeout_s, max_calls=4), RateLimitedLog(log))
        self.lease = Lease(
            lambda key: self._call("read", self._read_gen, key, what="lease"),
            lambda key, value, gen: self._call("write", self._write_if, key, value, gen, what="lease"),
            self.server_id,
            cfg.lease_ttl_s,
        )
        self.index: LruIndex | None = None
        self._folded: list[str] = []  # journal objects in the index, not yet checkpointed
        self._folded_set: set[str] = set()
        self._last_ckpt = time.monotonic()
        self._dirty = False
        self._used = 0  # the store's size as last seen (our index, or the holder's usage.json)
        self._since = 0  # bytes this server wrote since then
        self._markers: dict[str, float] = {}  # handover marker key -> written, as last read
        self.counters = Counters(
            "evict_passes",
            "evicted_pages",
            "evicted_bytes",
            "evict_skipped_unremovable",
            "journal_writes",
            "journal_folded",
            "checkpoints",
            "handover_markers_swept",
            "maintenance_errors",
        )
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()  # one tick at a time
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="l3-capacity", daemon=True)
            self._thread.start()

    # -- called by the client (any thread; cheap) --------------------------------------
    def record(self, items, written_bytes: int = 0) -> None:
        """Pages read or written: (store key, value size) pairs."""
        self.journal.record(items)
        if written_bytes:
            self._since += written_bytes
            if self.cfg.max_bytes and self._used + self._since > self.cfg.max_bytes:
                self._wake.set()

    # -- the thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait(self.cfg.tick_s)
            self._wake.clear()
            if self._stop:
                return
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the next tick tries again
                self.counters.add(maintenance_errors=1)
                self.guard.ratelog.warning("tick", "L3 capacity tick failed: %s: %s", type(e).__name__, e)

    def tick(self, final: bool = False) -> None:
        """One maintenance step (see the module docstring). `final`: checkpoint and release."""
        with self._lock:
            self._flush_journal()
            if not self.lease.acquire():
                self.index = None  # another server evicts; drop our copy of the index
                self._folded, self._folded_set = [], set()
                self._markers = {}
                self._read_usage()
                return
            if self.index is None:
                self._load_index()
            self._fold_journal()
            self.evict(self._needed())
            # A checkpoint rewrites the whole index (~58 B a page): at most every `checkpoint_s`,
            # and less often for a big index, unless the journal piles up.
            every = max(self.cfg.checkpoint_s, self.index.pages / 20_000)
            due = time.monotonic() - self._last_ckpt > every or len(self._folded) > 4096
            if final or (self._dirty and due):
                self._checkpoint()
            self._publish_usage()
            self._sweep_markers()
            if final:
                self.lease.release()

    def _flush_journal(self) -> None:
        taken = self.journal.take()
        if taken is None:
            return
        key, seg = taken
        try:
            self._call("write", self._write_if, key, seg.encode(), None, what="journal")
            self.counters.add(journal_writes=1)
        except Exception:
            self.journal.put_back(seg)
            raise

    def _load_index(self) -> None:
        value, _ = self._call("read", self._read_gen, INDEX, what="index")
        self.index, self._folded = LruIndex(), []
        if value is not None:
            try:
                self.index, self._folded = LruIndex.decode(value)
            except (ValueError, KeyError, TypeError) as e:  # start over from the journal
                log.warning("L3: unreadable index checkpoint %s (%s); rebuilding from the journal", INDEX, e)
        self._folded_set = set(self._folded)
        self._dirty = bool(self._folded)

    def _fold_journal(self) -> None:
        keys = sorted(self._call("read", self._store().list_keys, JOURNAL, what="list"))
        # Only objects named as journals are ours: folded ones are deleted after a checkpoint.
        new = [k for k in keys if k not in self._folded_set and is_journal_key(k)]
        for i in range(0, len(new), 64):
            batch = new[i : i + 64]
            values = self._call("read", self._store().get, batch, what="journal")
            for key, value in zip(batch, values):
                if value is not None:
                    try:
                        self.index.fold(Segment.decode(value))
                    except (ValueError, KeyError, TypeError) as e:
                        log.warning("L3: skipping unreadable journal object %s: %s", key, e)
                self._folded.append(key)
                self._folded_set.add(key)
            self.counters.add(journal_folded=len(batch))
            self._dirty = True
        self._used, self._since = self.index.total_bytes, 0

    def _sweep_markers(self) -> None:
        """Sweep handover markers (evictor only). Its failure is counted and logged, and
        leaves the rest of the tick done: markers are hints, a late sweep costs nothing."""
        board = HandoverBoard(
            self._store(), max_markers=self.cfg.handover_max_markers, max_age_s=self.cfg.handover_max_age_s
        )
        known = dict(self._markers)  # a copy: a sweep abandoned at its deadline may still fill it
        try:
            n = self._call("write", lambda: board.sweep(known=known), what="handover")
        except Exception as e:  # noqa: BLE001 - the next tick sweeps again
            self.counters.add(maintenance_errors=1)
            self.guard.ratelog.warning("handover", "L3 handover sweep failed: %s: %s", type(e).__name__, e)
            return
        self._markers = known
        self.counters.add(handover_markers_swept=n)

    def _needed(self) -> int:
        """Bytes to evict now to get back under every limit (0: none)."""
        used, cfg, need = self.index.total_bytes, self.cfg, 0
        if cfg.max_bytes and used > cfg.max_bytes:
            need = used - int(cfg.low_watermark * cfg.max_bytes)
        free = self.free_bytes() if cfg.min_free_bytes else None
        if free is not None and free < cfg.min_free_bytes:
            need = max(need, int(cfg.min_free_bytes / cfg.low_watermark) - free)
        return need

    def sync(self) -> bool:
        """Take the lease and bring the index up to date with the journal (False: another
        server holds the lease). For tools; the thread does this in `tick`."""
        with self._lock:
            if not self.lease.acquire():
                return False
            if self.index is None:
                self._load_index()
            self._fold_journal()
            return True

    def evict(self, nbytes: int) -> int:
        """Evict at least `nbytes` of least-recently-used pages (lease holder only); returns
        the bytes removed."""
        if nbytes <= 0 or self.index is None:
            return 0
        return self.remove(self.index.victims(nbytes))

    def remove(self, victims: np.ndarray, progress: Callable[[int], None] | None = None) -> int:
        """Delete the index rows `victims` in order, in batches, while we hold the lease;
        returns the bytes removed. Pages that cannot be removed are skipped, marked and
        counted. `progress(n)` is called after each batch with the pages it handled."""
        idx = self.index
        removed = 0
        done, stuck = [], []
        for i in range(0, len(victims), self.cfg.delete_batch):
            if not self.lease.held(margin=self.cfg.timeout_s) and not self.lease.acquire():
                break  # we lost the lease: stop rather than race a new holder
            at = victims[i : i + self.cfg.delete_batch]
            ok = self._delete(idx.paths(at))
            done.append(at[ok])
            stuck.append(at[~ok])
            removed += idx.bytes_of(at[ok])
            if progress is not None:
                progress(len(at))
        done_at = np.concatenate(done) if done else np.zeros(0, np.int64)
        stuck_at = np.concatenate(stuck) if stuck else np.zeros(0, np.int64)
        idx.mark_stuck(stuck_at)
        idx.remove(done_at)
        self.counters.add(
            evict_passes=1,
            evicted_pages=len(done_at),
            evicted_bytes=removed,
            evict_skipped_unremovable=len(stuck_at),
        )
        if len(stuck_at):
            self.guard.ratelog.warning(
                "stuck", "L3 eviction skipped %d pages that cannot be removed", len(stuck_at)
            )
        self._dirty = True
        self._used = idx.total_bytes
        return removed

    def forget(self, ns_prefix: str = "") -> None:
        """Pages under `ns_prefix` (a namespace dir or its start) were cleared; "": the whole
        store (pages and the meta records) was. Touches not yet journaled of those pages are
        dropped. As the evictor, a namespace's rows leave the index (the next checkpoint
        stores that); a whole clear drops the index, reloaded from the emptied store next
        tick. Another server's index keeps rows of the cleared pages until its eviction
        reaches them (deleting a missing page is a no-op) or ``gc --rebuild``."""
        self.journal.drop(ns_prefix)
        with self._lock:
            if not ns_prefix:
                self.index, self._folded, self._folded_set = None, [], set()
                self._used = self._since = 0
            elif self.index is not None:
                self.index.remove(self.index.select(ns_prefix))
                self._dirty = True
                self._used, self._since = self.index.total_bytes, 0

    def checkpoint(self) -> None:
        with self._lock:
            self._checkpoint()
            self._publish_usage()

    def _delete(self, paths: list[str]) -> np.ndarray:
        """Which of `paths` are gone: one call for the batch; if it fails, one per page.
        Not through the guard: a page's own failure must not open the breaker and stop the
        pass (the store's deadline bounds each call); a timeout does stop the pass."""
        store = self._store()
        try:
            store.delete(paths)
            return np.ones(len(paths), bool)
        except TimeoutError:
            raise
        except Exception:  # noqa: BLE001 - find the page(s) that failed
            pass
        ok = np.zeros(len(paths), bool)
        for j, p in enumerate(paths):
            try:
                store.delete([p])
                ok[j] = True
            except TimeoutError:
                raise
            except Exception:  # noqa: BLE001 - un-removable: skipped and counted
                pass
        return ok

    def _checkpoint(self) -> None:
        self._call("write", self._write_if, INDEX, self.index.encode(self._folded), None, what="checkpoint")
        done, self._folded, self._folded_set = self._folded, [], set()
        for i in range(0, len(done), self.cfg.delete_batch):
            self._call("write", self._store().delete, done[i : i + self.cfg.delete_batch], what="journal")
        self._last_ckpt, self._dirty = time.monotonic(), False
        self.counters.add(checkpoints=1)

    def _publish_usage(self) -> None:
        body = {"bytes": self.index.total_bytes, "pages": self.index.pages, "t": time.time()}
        self._call("write", self._write_if, USAGE, json.dumps(body).encode(), None, what="usage")

    def _read_usage(self) -> None:
        value, _ = self._call("read", self._read_gen, USAGE, what="usage")
        if value is not None:
            self._used, self._since = int(json.loads(value)["bytes"]), 0

    # -- store access ---------------------------------------------------------------
    def _call(self, path: str, fn, *args, what: str):
        return self.guard.run(path, fn, *args, what=what)

    def _read_gen(self, key: str):
        return self._store().read_generation(key)

    def _write_if(self, key: str, value, generation) -> bool:
        return self._store().write_if(key, value, generation)

    # -- reporting / shutdown ----------------------------------------------------------
    def stats(self) -> Metrics:
        return self.counters.snapshot().counters({"journal_dropped": self.journal.dropped})

    def health(self) -> Metrics:
        """Gauges: the store's size as last seen, and whether this server is the evictor."""
        out = Metrics().gauges(
            {
                "capacity_used_bytes": self._used + self._since,
                "capacity_evictor_used": int(self.lease.held()),
            }
        )
        if self.index is not None:
            out.gauges({"capacity_pages_used": self.index.pages})
        return out

    def close(self, final_tick: bool = True) -> None:
        """Stop the thread; with `final_tick`, flush the journal and, as the evictor, evict,
        checkpoint and release the lease (bounded by the store calls' deadlines)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.timeout_s)
        if final_tick:
            try:
                self.tick(final=True)
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                log.warning("L3 capacity: final tick failed: %s: %s", type(e).__name__, e)
        self.guard.close()
