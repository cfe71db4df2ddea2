"""Logging at a bounded rate: a failing L3 must not write one line per page."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most one record per `topic` per `interval_s`; the next record that goes out
    says how many were suppressed in between. Thread-safe."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ):
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, topic: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless `topic` logged less than `interval_s` ago; True if logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(topic)
            if last is not None and now - last < self.interval_s:
                self._suppressed[topic] = self._suppressed.get(topic, 0) + 1
                return False
            self._last[topic] = now
            skipped = self._suppressed.pop(topic, 0)
        if skipped:
            msg += f" (+{skipped} more suppressed)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, topic: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, topic, msg, *args)
