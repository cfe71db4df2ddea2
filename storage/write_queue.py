"""WriteQueue: the L3 write-behind queue, bounded in bytes, drained by one thread.

Invariants:
  * page bytes queued + being written never exceed `max_bytes`; `offer` never blocks, it
    refuses what does not fit (the caller counts it as a skipped backup);
  * a key is queued at most once at a time;
  * every accepted page is settled exactly once -- by the drain thread after its write
    (`write_batch` settles its tickets) or by `close`, which abandons what is still queued --
    so no caller waits forever on a `Ticket`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import numpy as np


class Ticket:
    """Completion of one `offer`: resolves to the pages written once none is pending."""

    def __init__(self, count: int):
        self.future: Future[int] = Future()
        self.remaining = count
        self.written = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # the drain thread and close() may settle one offer
        if count == 0:
            self.future.set_result(0)

    def settle(self, written: int, error: BaseException | None) -> None:
        """Called once per page of the offer."""
        with self._lock:
            self.remaining -= 1
            self.written += written
            self.error = self.error or error
            last = self.remaining == 0
        if last:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.written)


@dataclasses.dataclass
class WriteItem:
    key: str
    arrays: Mapping[str, np.ndarray]
    fingerprint: str
    nbytes: int
    ticket: Ticket


@dataclasses.dataclass(frozen=True)
class DrainReport:
    """What a bounded wait for the write queue did."""

    written: int  # pages settled (stored, found stored, or failed) during the wait
    pending: int  # pages still queued or being written when the wait ended
    seconds: float

    @property
    def complete(self) -> bool:
        return self.pending == 0


class WriteQueue:
    """FIFO of page writes; one daemon thread hands batches of at most `batch_size` pages
    and `max_batch_bytes` bytes to `write_batch`, which must settle every item's ticket."""

    def __init__(
        self,
        write_batch: Callable[[list[WriteItem]], None],
        *,
        max_bytes: int,
        batch_size: int,
        max_batch_bytes: int,
    ):
        self._write_batch = write_batch
        self.max_bytes = max_bytes
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        self._cond = threading.Condition()
        self._queue: collections.deque[WriteItem] = collections.deque()
        self._keys: set[str] = set()  # queued or being written
        self._bytes = 0  # of those pages
        self._in_flight = 0
        self._settled = 0  # pages settled so far (for drain reports)
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="l3-writer", daemon=True)
        self._thread.start()

    def offer(
        self, pages: Sequence[tuple[str, Mapping[str, np.ndarray]]], fingerprint: str
    ) -> tuple[Future[int], int, int]:
        """Queue the pages that are not queued already and fit; returns (the offer's future,
        pages refused for lack of room, pages already queued)."""
        full = dup = 0
        with self._cond:
            if self._closing:
                raise RuntimeError("the L3 write queue is closed")
            fresh: list[tuple[str, Mapping[str, np.ndarray], int]] = []
            for key, arrays in pages:
                if key in self._keys:
                    dup += 1
                    continue
                nbytes = sum(np.asarray(a).nbytes for a in arrays.values())
                if self._bytes + nbytes > self.max_bytes:
                    full += 1
                    continue
                self._keys.add(key)
                self._bytes += nbytes
                fresh.append((key, arrays, nbytes))
            ticket = Ticket(len(fresh))
            self._queue.extend(WriteItem(k, a, fingerprint, n, ticket) for k, a, n in fresh)
            self._cond.notify_all()
        return ticket.future, full, dup

    def pending(self) -> tuple[int, int]:
        """(pages, bytes) queued or being written."""
        with self._cond:
            return len(self._queue) + self._in_flight, self._bytes

    def wait_empty(self, timeout: float | None = None) -> bool:
        """Wait until every accepted page is settled; False on timeout."""
        with self._cond:
            return self._cond.wait_for(self._empty, timeout)

    def drain(self, timeout: float) -> DrainReport:
        """Wait up to `timeout` for the queue to empty; what is left stays queued."""
        t0 = time.monotonic()
        with self._cond:
            before = self._settled
            self._cond.wait_for(self._empty, timeout)
            pending = len(self._queue) + self._in_flight
            written = self._settled - before
        return DrainReport(written, pending, time.monotonic() - t0)

    def close(self, timeout: float) -> tuple[DrainReport, int]:
        """Refuse new pages, drain for up to `timeout`, then abandon (settle as not written)
        what is still queued; returns the drain report and the number abandoned. The page
        being written, if any, is settled by its write, which its own deadline bounds."""
        with self._cond:
            self._closing = True
        report = self.drain(timeout)
        with self._cond:
            abandoned = list(self._queue)
            self._queue.clear()
            for item in abandoned:
                self._keys.discard(item.key)
                self._bytes -= item.nbytes
            self._settled += len(abandoned)
            self._cond.notify_all()
        for item in abandoned:
            item.ticket.settle(0, None)
        self._thread.join(timeout=0.1)  # it ends after its current batch; nobody waits for it
        return report, len(abandoned)

    def _empty(self) -> bool:
        return not self._queue and not self._in_flight

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch = [self._queue.popleft()]
                nbytes = batch[0].nbytes
                while self._queue and len(batch) < self.batch_size:
                    if nbytes + self._queue[0].nbytes > self.max_batch_bytes:
                        break
                    batch.append(self._queue.popleft())
                    nbytes += batch[-1].nbytes
                self._in_flight = len(batch)
            try:
                self._write_batch(batch)
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._bytes -= nbytes
                    self._keys.difference_update(item.key for item in batch)
                    self._settled += len(batch)
                    self._cond.notify_all()
