"""PrefetchHandle: the pages of one ordered L3 read (``StorageClient.prefetch``), arriving in key order."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np

Page = dict[str, np.ndarray]  # array name -> array, as the codec decodes it


class PrefetchHandle:
    """Pages of one prefetch, arriving in key order. Thread-safe.

    `ready()` never blocks; `result()` and iteration wait. After `cancel()` no further
    batch is read; pages already decoded stay available.
    """

    def __init__(self, keys: Sequence[str]):
        self.keys = tuple(keys)
        self._pages: list[Page] = []  # the good prefix so far
        self._cond = threading.Condition()
        self._done = False
        self._cancelled = False

    # -- reader side -------------------------------------------------------------
    def ready(self) -> int:
        """Number of leading pages decoded so far."""
        with self._cond:
            return len(self._pages)

    def done(self) -> bool:
        with self._cond:
            return self._done

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the prefetch ends; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def result(self, timeout: float | None = None) -> list[Page]:
        """The hit: the longest prefix of good pages. Raises TimeoutError if not done."""
        if not self.wait(timeout):
            raise TimeoutError(f"prefetch of {len(self.keys)} pages not done in {timeout}s")
        with self._cond:
            return list(self._pages)

    def __iter__(self) -> Iterator[Page]:
        """Yield good pages in order as they arrive; stops at the first miss."""
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda i=i: len(self._pages) > i or self._done)
                if len(self._pages) <= i:
                    return
                page = self._pages[i]
            yield page
            i += 1

    # -- producer side (the storage client) --------------------------------------
    def cancelled(self) -> bool:
        with self._cond:
            return self._cancelled

    def add_page(self, page: Page) -> None:
        with self._cond:
            self._pages.append(page)
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
