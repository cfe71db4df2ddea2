"""A circuit breaker: stop calling a store that keeps failing, probe it now and then.

    closed --(threshold failures in a row)--> open --(backoff elapsed)--> half-open
       ^                                        ^                            |
       +------------ probe succeeds ------------+---- probe fails (backoff x2) +

While open every call is refused at once (the caller treats it as a miss or a skipped
write), so a dead store costs nothing per request. After the backoff exactly one call is
let through as a probe; its outcome closes the breaker or reopens it with a doubled backoff
(capped), so a store that stays down is probed -- and logged about -- at a falling rate.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclasses.dataclass(frozen=True)
class BreakerConfig:
    threshold: int = 3  # consecutive failures that open the breaker
    backoff_s: float = 1.0  # first wait before a probe
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"BreakerConfig.threshold must be >= 1, got {self.threshold}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"BreakerConfig needs 0 < backoff_s <= max_backoff_s, got {self.backoff_s}, "
                f"{self.max_backoff_s}"
            )


class CircuitBreaker:
    """Thread-safe. Invariants: while ``state() == OPEN`` `allow` refuses; in HALF_OPEN
    at most one caller holds the probe at a time; `success` always closes."""

    def __init__(self, cfg: BreakerConfig = BreakerConfig(), clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # consecutive
        self._backoff = cfg.backoff_s
        self._opened_at: float | None = None  # None: closed
        self._probing = False
        self.trips = 0  # closed -> open transitions

    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        return OPEN if self._clock() - self._opened_at < self._backoff else HALF_OPEN

    def retry_in(self) -> float:
        """Seconds until the next probe may go (0 when closed or half-open)."""
        with self._lock:
            if self._opened_at is None:
                return 0.0
            return max(0.0, self._opened_at + self._backoff - self._clock())

    def allow(self) -> str | None:
        """May a call go now? None: refused; ``"call"``: yes; ``"probe"``: yes, as the one
        probe of a half-open breaker, which must report `success` or `failure(probe=True)`."""
        with self._lock:
            state = self._state()
            if state == CLOSED:
                return "call"
            if state == HALF_OPEN and not self._probing:
                self._probing = True
                return "probe"
            return None

    def success(self) -> bool:
        """Record a good call; True if this closed an open breaker."""
        with self._lock:
            recovered = self._opened_at is not None
            self._failures = 0
            self._opened_at = None
            self._probing = False
            self._backoff = self.cfg.backoff_s
            return recovered

    def failure(self, probe: bool = False) -> bool:
        """Record a failed call; True if this opened (or reopened) the breaker."""
        with self._lock:
            self._failures += 1
            if self._opened_at is not None:
                if not probe:
                    return False  # a straggler from before the trip: no new information
                self._probing = False
                self._backoff = min(2 * self._backoff, self.cfg.max_backoff_s)
                self._opened_at = self._clock()
                return True
            if self._failures >= self.cfg.threshold:
                self._opened_at = self._clock()
                self.trips += 1
                return True
            return False
