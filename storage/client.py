"""StorageClient: the engine's one door to L3 (background prefetch and write-behind).

It takes keys and numpy arrays and gives back numpy arrays: no request objects, no
engine imports. Reads run on a small thread pool, writes on one writer thread; the
caller never waits on I/O unless it asks to (`PrefetchHandle.result`, `flush`).

Invariant: a page that is missing, unreadable or fails its checksum is a miss. A
prefetch hit is the longest run of good pages from the first key; nothing after the
first miss is ever returned.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hicache_jax.storage.base import L3Store
from hicache_jax.storage.codec import CorruptPage, decode_page, encode_page
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.prefetch import PrefetchHandle
from hicache_jax.storage.stats import Counters

log = logging.getLogger(__name__)

# Failures that say the stored bytes are damaged (rewriting the key repairs them). Other
# reasons (version, namespace, key) may be another writer's valid page: leave it alone.
_REPAIRABLE = ("truncated", "checksum", "bad_magic", "format")


class _Ticket:
    """Completion of one `write_async` call: resolves when the client holds none of its arrays."""

    def __init__(self, count: int):
        self.future: Future[int] = Future()
        self.remaining = count
        self.written = 0
        self.error: BaseException | None = None

    def settle(self, written: int, error: BaseException | None) -> None:
        """Called by the writer thread only, once per item."""
        self.remaining -= 1
        self.written += written
        self.error = self.error or error
        if self.remaining == 0:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.written)


class StorageClient:
    """Background L3 reads and writes of codec pages for one namespace.

    Owns `store` (closes it in `close`). `namespace` is the default for every call;
    a per-call namespace serves requests with their own `cache_salt`.
    """

    def __init__(
        self,
        store: L3Store,
        namespace: Namespace,
        *,
        batch_size: int = 128,
        prefetch_threads: int = 2,
        remember_stored: int = 1 << 16,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.store = store
        self.namespace = namespace
        self.batch_size = batch_size
        self._pool = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="l3-prefetch")
        self._io = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="l3-read")
        self._stats = Counters(
            "reads",
            "read_misses",
            "bytes_read",
            "read_errors",
            "checksum_failures",
            "writes",
            "bytes_written",
            "skipped_writes",
            "write_errors",
        )
        # Writer state, all guarded by _cond.
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, Mapping[str, np.ndarray], str, _Ticket]]
        self._queue = collections.deque()
        self._queued: set[str] = set()  # keys queued or being written
        self._in_flight = 0
        self._stored: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember_stored
        self._closing = False
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="l3-writer", daemon=True)
        self._writer.start()

    # -- reads -------------------------------------------------------------------
    def prefetch(self, keys: Sequence[str], namespace: Namespace | None = None) -> PrefetchHandle:
        """Start reading `keys` in the background; returns at once.

        Keys are read in batches of `batch_size`, the reads of a batch issued together
        (the store bounds how many are in flight) and the next batch read while this one
        is decoded; reading stops at the first miss or corrupt page. Pages are read-only
        numpy views of the stored bytes.
        """
        if self._closing:
            raise RuntimeError("StorageClient is closed")
        handle = PrefetchHandle(keys)
        fingerprint = (namespace or self.namespace).fingerprint
        if not handle.keys:
            handle.finish()
        else:
            self._pool.submit(self._read_pages, handle, fingerprint)
        return handle

    def match_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (one batched existence probe; no data read)."""
        present = self.store.exists(keys) if keys else []
        return next((i for i, p in enumerate(present) if not p), len(present))

    def _read_pages(self, handle: PrefetchHandle, fingerprint: str) -> None:
        # One batch of look-ahead: batch i+1 is being read while batch i is checksummed
        # and decoded, so the disk does not idle during decode. At most one batch past a
        # miss is read in vain.
        size = self.batch_size
        batches = [handle.keys[i : i + size] for i in range(0, len(handle.keys), size)]
        ahead = self._io.submit(self.store.get, batches[0])
        try:
            for i, batch in enumerate(batches):
                values = ahead.result()
                if handle.cancelled():
                    return
                if i + 1 < len(batches):
                    ahead = self._io.submit(self.store.get, batches[i + 1])
                if not self._decode_batch(handle, batch, values, fingerprint):
                    return
        except Exception:  # noqa: BLE001 - an L3 failure is a miss, never a crash
            log.exception("L3 prefetch failed; treating the rest as a miss")
            self._stats.add(read_errors=1)
        finally:
            handle.finish()

    def _decode_batch(
        self,
        handle: PrefetchHandle,
        batch: Sequence[str],
        values: Sequence[bytes | None],
        fingerprint: str,
    ) -> bool:
        """Decode one batch into `handle`; False once a page misses."""
        for key, value in zip(batch, values, strict=True):
            if value is None:
                self._stats.add(read_misses=1)
                self._forget(key)
                return False
            try:
                page = decode_page(value, fingerprint, expected_key=key)
            except CorruptPage as e:
                log.warning("L3 page %s unusable: %s", key, e)
                self._stats.add(checksum_failures=1)
                if e.reason in _REPAIRABLE:
                    self._forget(key)
                    self.store.delete([key])  # so that the next write repairs it
                return False
            self._stats.add(reads=1, bytes_read=len(value))
            self._remember_stored([key])
            handle.add_page(page)
        return True

    # -- writes ------------------------------------------------------------------
    def write_async(
        self,
        items: Sequence[tuple[str, Mapping[str, np.ndarray]]],
        namespace: Namespace | None = None,
    ) -> Future[int]:
        """Queue pages for L3 and return at once.

        Keys already stored (as far as this client knows) or already queued are dropped.
        The caller must not modify the arrays it passed until the returned future is
        done; the future resolves to the number of pages this call wrote.
        """
        fingerprint = (namespace or self.namespace).fingerprint
        with self._cond:
            if self._closing:
                raise RuntimeError("StorageClient is closed")
            fresh = []
            for key, arrays in items:
                if key in self._queued or key in self._stored:
                    continue
                self._queued.add(key)
                fresh.append((key, arrays))
            ticket = _Ticket(len(fresh))
            for key, arrays in fresh:
                self._queue.append((key, arrays, fingerprint, ticket))
            self._cond.notify_all()
        self._stats.add(skipped_writes=len(items) - len(fresh))
        if not fresh:
            ticket.future.set_result(0)
        return ticket.future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is stored; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                n = min(len(self._queue), self.batch_size)
                batch = [self._queue.popleft() for _ in range(n)]
                self._in_flight = n
            self._write_batch(batch)
            with self._cond:
                self._in_flight = 0
                self._queued.difference_update(key for key, *_ in batch)
                self._cond.notify_all()

    def _write_batch(self, batch: list[tuple[str, Mapping[str, np.ndarray], str, _Ticket]]) -> None:
        encoded: list[tuple[str, bytes]] = []
        errors: dict[str, BaseException] = {}
        for key, arrays, fingerprint, _ in batch:
            try:
                encoded.append((key, encode_page(arrays, fingerprint, key)))
            except Exception as e:  # noqa: BLE001 - reported through the caller's future
                errors[key] = e
        written: set[str] = set()
        nbytes = skipped = 0
        if encoded:
            try:
                # Probe here rather than inside put() so each page knows whether it was
                # written; a page another writer adds in between is rewritten (harmless).
                present = self.store.exists([k for k, _ in encoded])
                todo = [item for item, p in zip(encoded, present, strict=True) if not p]
                self.store.put(todo, force=True)
                written = {k for k, _ in todo}
                nbytes = sum(len(v) for _, v in todo)
                skipped = len(encoded) - len(todo)
                self._remember_stored([k for k, _ in encoded])
            except Exception as e:  # noqa: BLE001 - reported through the futures
                log.exception("L3 write of %d pages failed", len(encoded))
                errors.update((k, e) for k, _ in encoded)
        self._stats.add(
            writes=len(written),
            bytes_written=nbytes,
            skipped_writes=skipped,
            write_errors=len(errors),
        )
        for key, _, _, ticket in batch:
            ticket.settle(int(key in written), errors.get(key))

    # -- bookkeeping -------------------------------------------------------------
    def _remember_stored(self, keys: Sequence[str]) -> None:
        with self._cond:
            for key in keys:
                self._stored[key] = None
                self._stored.move_to_end(key)
            while len(self._stored) > self._remember:
                self._stored.popitem(last=False)

    def _forget(self, key: str) -> None:
        with self._cond:
            self._stored.pop(key, None)

    def clear(self) -> None:
        """Flush, then delete every page of the store (all namespaces)."""
        self.flush()
        self.store.clear()
        with self._cond:
            self._stored.clear()

    def stats(self) -> dict[str, int]:
        """Counters plus the `pending_writes` gauge (queued or being written)."""
        out = self._stats.snapshot()
        with self._cond:
            out["pending_writes"] = len(self._queue) + self._in_flight
        return out

    def close(self) -> None:
        """Write everything queued, stop the threads, close the store. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
        self._writer.join()
        self._pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.store.close()
        self._closed = True

    def __enter__(self) -> StorageClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
