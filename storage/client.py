"""StorageClient: the engine's one door to L3 (background prefetch and write-behind).

It takes keys and numpy arrays and gives back numpy arrays: no request objects, no
engine imports. Reads run on a small thread pool, writes on one writer thread; the
caller never waits on I/O unless it asks to (`PrefetchHandle.result`, `drain`), and then
never longer than a deadline.

Invariants:
  * A page that is missing, unreadable, late or fails its checksum is a miss. A prefetch
    hit is the longest run of good pages from the first key; nothing after the first miss
    is ever returned.
  * Every store call goes through a `StoreGuard`: it ends within `timeout_s`, and while
    the store keeps failing it is not called at all (circuit breaker).
  * The write queue holds at most `max_queue_bytes` of page data (queued + being
    written); `write_async` never blocks: a page that does not fit, or arrives while
    writes are refused, is skipped and counted.
  * `_stored` (keys this client believes are in L3, so it need not write them again) only
    holds keys L3 confirmed; a read or probe that finds a key gone removes it, so a cleared
    or evicted L3 fills again on the next backup.
  * With an `auth_key`, every page written carries a MAC and every page read must pass it
    (codec.py); the namespace's `auth_id` is that key's id. The key lives only here.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hicache_jax.metric_kinds import Metrics
from hicache_jax.storage.auth import key_id
from hicache_jax.storage.base import L3Store
from hicache_jax.storage.breaker import BreakerConfig
from hicache_jax.storage.capacity import Capacity, CapacityConfig
from hicache_jax.storage.clearing import own_scope
from hicache_jax.storage.codec import CorruptPage, decode_page, encode_page
from hicache_jax.storage.guard import GuardConfig, L3Unavailable, StoreGuard
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.layout import LegacyLayout, check_layout
from hicache_jax.storage.ratelog import RateLimitedLog
from hicache_jax.storage.read_handle import PrefetchHandle
from hicache_jax.storage.stats import Counters
from hicache_jax.storage.write_queue import DrainReport, WriteItem, WriteQueue

log = logging.getLogger(__name__)

# Damaged bytes: the page is deleted (every reader would reject it) and rewritten by the
# next backup of it. A page failing its MAC ("auth") is handled the same way: under our
# auth_id path no holder of the key wrote it (they write valid MACs) and no server without
# the key reads there (its namespace differs), so nobody loses a page they could use; and
# deleting it gives its writer nothing (who can write the store can delete from it).
_DAMAGED = ("truncated", "checksum", "bad_magic", "format", "auth")
# A whole, valid page of another namespace or key: misplaced or swapped, since keys hash the
# namespace digest and the whole prefix -- or the reader asked with the wrong namespace. Not
# deleted (that reader may be the one in error), but our next backup of the key overwrites it.
_MISPLACED = ("namespace", "key")
# A page of another codec version may be a newer server's valid page: left alone.
_REASONS = (*_DAMAGED, *_MISPLACED, "version")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    batch_size: int = 128  # pages per store call
    prefetch_threads: int = 2
    remember_stored: int = 1 << 16  # keys known to be stored (skipped by write_async)
    timeout_s: float = 5.0  # deadline of one store call
    max_queue_bytes: int = 256 << 20  # page bytes queued or being written
    max_batch_bytes: int = 64 << 20  # page bytes per write call (so one deadline fits it)
    max_store_calls: int = 8  # store calls alive at once, abandoned ones included
    breaker: BreakerConfig = BreakerConfig()
    capacity: CapacityConfig = CapacityConfig()  # size cap / free-space floor (off by default)
    check_layout: bool = True  # refuse a store in the old flat layout

    def __post_init__(self) -> None:
        for name in ("batch_size", "prefetch_threads", "remember_stored", "max_store_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClientConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout_s", "max_queue_bytes", "max_batch_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClientConfig.{name} must be > 0, got {getattr(self, name)}")


class StorageClient:
    """Background L3 reads and writes of codec pages for one namespace.

    Owns `store` (closes it in `close`). `namespace` is the default for every call;
    a per-call namespace serves requests with their own `cache_salt`. `config` fields may
    also be given as keyword arguments.
    """

    def __init__(
        self,
        store: L3Store,
        namespace: Namespace,
        config: ClientConfig | None = None,
        *,
        free_bytes=None,
        auth_key: bytes | None = None,
        **overrides,
    ):
        """`free_bytes`: a free-space probe for the capacity floor (default: the store's).
        `auth_key`: the page-auth key (auth.py); `namespace.auth_id` must be its id."""
        want = None if auth_key is None else key_id(auth_key)
        if namespace.auth_id != want:
            raise ValueError(
                f"Namespace.auth_id={namespace.auth_id!r} does not match the auth key given "
                f"(its id: {want!r}; None: no key)"
            )
        self._auth_key = auth_key
        cfg = dataclasses.replace(config or ClientConfig(), **overrides)
        self.cfg = cfg
        self.store = store
        self.namespace = namespace
        self.batch_size = cfg.batch_size
        self.ratelog = RateLimitedLog(log)
        self.guard = StoreGuard(GuardConfig(cfg.timeout_s, cfg.max_store_calls, cfg.breaker), self.ratelog)
        self._pool = ThreadPoolExecutor(cfg.prefetch_threads, thread_name_prefix="l3-prefetch")
        self._io = ThreadPoolExecutor(cfg.prefetch_threads, thread_name_prefix="l3-read")
        self._stats = Counters(
            "reads",
            "read_misses",
            "bytes_read",
            "read_errors",
            "checksum_failures",
            *(f"corrupt_{r}" for r in _REASONS),
            "writes",
            "bytes_written",
            "skipped_writes",
            "write_errors",
            "writes_dropped_queue_full",
            "writes_dropped_unavailable",
            "writes_abandoned",
            "stored_forgotten",
        )
        self._lock = threading.Lock()  # guards the three below
        self._stored: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._overwrite: collections.OrderedDict[str, None] = collections.OrderedDict()  # bad keys
        self._reading: set[PrefetchHandle] = set()  # prefetches not finished yet
        self._closing = False  # set once, by close()
        self._writes = WriteQueue(
            self._write_batch,
            max_bytes=cfg.max_queue_bytes,
            batch_size=cfg.batch_size,
            max_batch_bytes=cfg.max_batch_bytes,
        )
        if cfg.check_layout:
            self._check_layout()
        self.capacity: Capacity | None = None
        if cfg.capacity.enabled:
            self.capacity = Capacity(lambda: self.store, cfg.capacity, free_bytes=free_bytes)

    def _check_layout(self) -> None:
        """Once, at start: refuse an old flat store (`LegacyLayout`); mark a new one. An
        unreachable store is only logged (it is checked again by the next server start)."""
        if type(self.store).list_keys is L3Store.list_keys:
            return  # a store without listing (a test double): nothing to check
        try:
            self.guard.run("read", check_layout, self.store, what="layout")
        except LegacyLayout:
            raise
        except Exception as e:  # noqa: BLE001 - L3 down at start: serve, and say so
            self.ratelog.warning("layout", "L3 layout check failed: %s: %s", type(e).__name__, e)

    # -- reads -------------------------------------------------------------------
    def prefetch(self, keys: Sequence[str], namespace: Namespace | None = None) -> PrefetchHandle:
        """Start reading `keys` in the background; returns at once.

        Keys are read in batches of `batch_size`, the reads of a batch issued together
        (the store bounds how many are in flight) and the next batch read while this one
        is decoded; reading stops at the first miss or corrupt page. Pages are read-only
        numpy views of the stored bytes. Each batch read ends within `timeout_s`.
        """
        if self._closing:
            raise RuntimeError("StorageClient is closed")
        handle = PrefetchHandle(keys)
        fingerprint = (namespace or self.namespace).fingerprint
        if not handle.keys:
            handle.finish()
        else:
            with self._lock:
                self._reading.add(handle)
            self._pool.submit(self._read_pages, handle, fingerprint)
        return handle

    def reads_available(self) -> bool:
        """False while the read breaker is open: a prefetch now would only miss."""
        return self.guard.available("read")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Existence probes, `batch_size` keys per store call, each call within its deadline;
        keys found missing are forgotten as stored. Raises `L3Unavailable`, `L3Timeout` or
        the store's error."""
        present: list[bool] = []
        for i in range(0, len(keys), self.batch_size):
            batch = list(keys[i : i + self.batch_size])
            got = self.guard.run("read", self.store.exists, batch, what="exists")
            self._forget([k for k, p in zip(batch, got, strict=True) if not p])
            present += got
        return present

    def match_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (one batched existence probe; no data read)."""
        present = self.exists(keys)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def _read_pages(self, handle: PrefetchHandle, fingerprint: str) -> None:
        # One batch of look-ahead: batch i+1 is being read while batch i is checksummed
        # and decoded, so the disk does not idle during decode. At most one batch past a
        # miss is read in vain.
        size = self.batch_size
        batches = [handle.keys[i : i + size] for i in range(0, len(handle.keys), size)]
        read = lambda batch: self.guard.run("read", self.store.get, batch, what="get")  # noqa: E731
        ahead = self._io.submit(read, batches[0])
        damaged: list[str] = []
        try:
            for i, batch in enumerate(batches):
                values = ahead.result()
                if handle.cancelled():
                    return
                if i + 1 < len(batches):
                    ahead = self._io.submit(read, batches[i + 1])
                if not self._decode_batch(handle, batch, values, fingerprint, damaged):
                    return
        except L3Unavailable:
            pass  # counted by the guard; a miss
        except Exception as e:  # noqa: BLE001 - an L3 failure is a miss, never a crash
            self._stats.add(read_errors=1)
            if not self._closing:
                self.ratelog.warning(
                    "prefetch", "L3 prefetch failed, the rest is a miss: %s: %s", type(e).__name__, e
                )
        finally:
            handle.finish()
            with self._lock:
                self._reading.discard(handle)
            if damaged:  # after finish(): the waiting request does not pay for the repair
                self._delete_damaged(damaged)

    def _decode_batch(
        self,
        handle: PrefetchHandle,
        batch: Sequence[str],
        values: Sequence[bytes | None],
        fingerprint: str,
        damaged: list[str],
    ) -> bool:
        """Decode one batch into `handle`; False once a page misses."""
        touched: list[tuple[str, int]] = []
        try:
            return self._decode_each(handle, batch, values, fingerprint, damaged, touched)
        finally:
            if touched and self.capacity is not None:
                self.capacity.record(touched[::-1])  # deepest first: evicted before its prefix

    def _decode_each(self, handle, batch, values, fingerprint, damaged, touched) -> bool:
        for key, value in zip(batch, values, strict=True):
            if value is None:
                self._stats.add(read_misses=1)
                self._forget([key])
                return False
            try:
                page = decode_page(value, fingerprint, expected_key=key, auth_key=self._auth_key)
            except CorruptPage as e:
                self.ratelog.warning("corrupt", "L3 page %s unusable: %s", key, e)
                self._stats.add(checksum_failures=1, **{f"corrupt_{e.reason}": 1})
                if e.reason in _DAMAGED + _MISPLACED:
                    self._forget([key], overwrite=True)
                if e.reason in _DAMAGED:
                    damaged.append(key)
                return False
            self._stats.add(reads=1, bytes_read=len(value))
            self._remember_stored([key])
            touched.append((key, len(value)))
            handle.add_page(page)
        return True

    def _delete_damaged(self, keys: list[str]) -> None:
        try:
            self.guard.run("write", self.store.delete, keys, what="delete")
        except Exception as e:  # noqa: BLE001 - the next write overwrites it anyway
            self.ratelog.warning("delete", "could not delete damaged L3 pages: %s: %s", type(e).__name__, e)

    # -- writes ------------------------------------------------------------------
    def write_async(
        self,
        items: Sequence[tuple[str, Mapping[str, np.ndarray]]],
        namespace: Namespace | None = None,
    ) -> Future[int]:
        """Queue pages for L3 and return at once (never blocks on I/O).

        Keys already stored (as far as this client knows) or already queued are dropped,
        and so are pages that do not fit the queue's byte bound or arrive while writes are
        refused (counted as ``writes_dropped_*``). The caller must not modify the arrays it
        passed until the returned future is done; the future resolves to the number of
        pages this call wrote.
        """
        if self._closing:
            raise RuntimeError("StorageClient is closed")
        fresh = [(key, arrays) for key, arrays in items if not self.is_known_stored(key)]
        known = len(items) - len(fresh)
        unavailable = 0
        if fresh and not self.guard.available("write"):
            unavailable, fresh = len(fresh), []
        future, full, queued = self._writes.offer(fresh, (namespace or self.namespace).fingerprint)
        self._stats.add(
            skipped_writes=known + queued,
            writes_dropped_queue_full=full,
            writes_dropped_unavailable=unavailable,
        )
        if full:
            self.ratelog.warning(
                "queue-full",
                "L3 write queue full (%d bytes): skipped %d pages",
                self.cfg.max_queue_bytes,
                full,
            )
        return future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is settled; False on timeout."""
        return self._writes.wait_empty(timeout)

    def drain(self, timeout: float) -> DrainReport:
        """Wait up to `timeout` for the write queue to empty. Pages still pending stay
        queued (they are copies: nothing the caller frees can change them)."""
        return self._writes.drain(timeout)

    def _write_batch(self, batch: list[WriteItem]) -> None:
        """On the queue's thread: encode, probe and put one batch; settle every ticket."""
        encoded: list[tuple[str, bytes]] = []
        errors: dict[str, BaseException] = {}
        for item in batch:
            try:
                encoded.append(
                    (item.key, encode_page(item.arrays, item.fingerprint, item.key, auth_key=self._auth_key))
                )
            except Exception as e:  # noqa: BLE001 - reported through the caller's future
                errors[item.key] = e
                self.ratelog.warning("encode", "cannot encode L3 page %s: %s", item.key, e)
        written: set[str] = set()
        nbytes = skipped = dropped = 0
        if encoded:
            try:
                todo = self.guard.run("write", self._probe_and_put, encoded, what="put")
                written = {k for k, _ in todo}
                nbytes = sum(len(v) for _, v in todo)
                skipped = len(encoded) - len(todo)
                self._remember_stored([k for k, _ in encoded])
                if self.capacity is not None:
                    touched = [(k, len(v)) for k, v in reversed(encoded)]  # deepest first, as on reads
                    self.capacity.record(touched, written_bytes=nbytes)
            except L3Unavailable:
                dropped = len(encoded)  # the breaker is open: a skipped backup, not an error
            except Exception as e:  # noqa: BLE001 - reported through the futures (the guard logged it)
                errors.update((k, e) for k, _ in encoded)
        self._stats.add(
            writes=len(written),
            bytes_written=nbytes,
            skipped_writes=skipped,
            write_errors=len(errors),
            writes_dropped_unavailable=dropped,
        )
        for item in batch:
            item.ticket.settle(int(item.key in written), errors.get(item.key))

    def _probe_and_put(self, encoded: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        # Probe here rather than inside put() so each page knows whether it was written; a
        # page another writer adds in between is rewritten (harmless). One deadline covers both.
        present = self.store.exists([k for k, _ in encoded])
        with self._lock:
            bad = {k for k, _ in encoded if k in self._overwrite}
        todo = [item for item, p in zip(encoded, present, strict=True) if not p or item[0] in bad]
        self.store.put(todo, force=True)
        with self._lock:
            for key in bad:
                self._overwrite.pop(key, None)
        return todo

    # -- bookkeeping -------------------------------------------------------------
    def _remember_stored(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._stored[key] = None
                self._stored.move_to_end(key)
            while len(self._stored) > self.cfg.remember_stored:
                self._stored.popitem(last=False)

    def _forget(self, keys: Sequence[str], overwrite: bool = False) -> None:
        """`keys` are not (good) in L3; with `overwrite`, the next write of each replaces
        whatever sits under it."""
        gone = 0
        with self._lock:
            for key in keys:
                if key in self._stored:
                    del self._stored[key]
                    gone += 1
                if overwrite:
                    self._overwrite[key] = None
                    while len(self._overwrite) > self.cfg.remember_stored:
                        self._overwrite.popitem(last=False)
        if gone:
            self._stats.add(stored_forgotten=gone)

    def is_known_stored(self, key: str) -> bool:
        with self._lock:
            return key in self._stored

    def clear(self, all_namespaces: bool = False) -> int:
        """Drain, then delete this client's namespace's pages, for every cache_salt tenant
        (`clearing.own_scope`); with `all_namespaces`, every namespace's pages and the
        evictor's records. Only keys this project wrote (`L3Store.clear`): other files in the
        store survive. Bounded by ten call deadlines in all; raises if the store could not
        be cleared (what was deleted stays deleted). Returns the keys deleted."""
        self.drain(self.cfg.timeout_s)
        scope = "" if all_namespaces else own_scope(self.namespace)
        limit = 10 * self.cfg.timeout_s
        deadline = time.monotonic() + limit
        try:
            return self.guard.run("write", self.store.clear, scope, deadline, what="clear", timeout=limit)
        finally:  # even a partial clear may have deleted any page we remember
            with self._lock:
                self._stored.clear()
            if self.capacity is not None:
                self.capacity.forget(scope)

    def stats(self) -> Metrics:
        """Counters plus the gauges `pending_writes` and `pending_write_bytes` (queued or
        being written), and the guard's counters."""
        out = self._stats.snapshot().add(self.guard.counters.snapshot())
        writes, nbytes = self._writes.pending()
        out.gauges({"pending_writes": writes, "pending_write_bytes": nbytes})
        if self.capacity is not None:
            out.add(self.capacity.stats())
        return out

    def health(self) -> Metrics:
        """Gauges: read/write breaker open (1/0), store calls stuck past their deadline, and
        with a capacity limit the store's size as last seen and whether we are the evictor."""
        out = self.guard.health()
        if self.capacity is not None:
            out.add(self.capacity.health())
        return out

    def close(self, timeout: float | None = None) -> DrainReport:
        """Write what is queued for up to `timeout` (default `timeout_s`), drop the rest,
        stop the threads, close the store. Returns at most about `timeout` later (plus one
        call deadline if a prefetch is mid-read). Idempotent."""
        timeout = self.cfg.timeout_s if timeout is None else timeout
        with self._lock:
            if self._closing:
                return DrainReport(0, 0, 0.0)
            self._closing = True  # no new writes or prefetches
        report, abandoned = self._writes.close(timeout)
        if abandoned:
            self._stats.add(writes_abandoned=abandoned)
            log.warning("L3: closing with %d page writes abandoned after %.1fs", abandoned, timeout)
        # The pools' threads only wait on guarded calls, which their deadlines bound: nobody
        # waits for them here.
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            reading, self._reading = list(self._reading), set()
        for handle in reading:  # a cancelled read would never finish its handle
            handle.cancel()
            handle.finish()
        if self.capacity is not None:
            self.capacity.close()  # its journal, and as the evictor a last pass and checkpoint
        self.guard.close()
        self.store.close()
        return report

    def __enter__(self) -> StorageClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
