"""StoreGuard: every L3 call gets a deadline and goes through a circuit breaker.

A store may hang in Python (a stuck network client, a blocked file system) where no
future can be given a timeout, so each call runs on a daemon thread of its own and the
caller waits on it for at most `timeout_s`. A call that overruns is abandoned: its thread
finishes (or never does) on its own, and is counted as stuck until it does. At most
`max_calls` calls are alive at once (running or stuck); more are refused at once, so a
dead store cannot pile up threads -- or the pages they hold -- without bound. (The client
makes at most 7 calls at once when healthy: 2 probes, 2 reads, 2 repairs, 1 write.)

Reads (`exists`, `get`) and writes (`put`, `delete`, `clear`) have separate breakers: a
store that is full (ENOSPC) still serves reads.

Failures are logged at a bounded rate: a breaker opening or closing is one line, other
failures at most one line per path per `RateLimitedLog.interval_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from hicache_jax.metric_kinds import Metrics
from hicache_jax.storage.breaker import CLOSED, OPEN, BreakerConfig, CircuitBreaker
from hicache_jax.storage.ratelog import RateLimitedLog
from hicache_jax.storage.stats import Counters

T = TypeVar("T")
PATHS = ("read", "write")

log = logging.getLogger(__name__)


class L3Unavailable(RuntimeError):
    """The call was refused without touching the store: its breaker is open, or too many
    earlier calls are stuck. The caller treats it as a miss or a skipped write."""


class L3Timeout(TimeoutError):
    """The store did not answer within the deadline; the call was abandoned."""


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    timeout_s: float = 5.0  # deadline of one call (one batch of pages)
    max_calls: int = 8  # calls alive at once, abandoned ones included; more are refused
    breaker: BreakerConfig = BreakerConfig()

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"GuardConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_calls < 1:
            raise ValueError(f"GuardConfig.max_calls must be >= 1, got {self.max_calls}")


class _Call:
    """One call on its own thread; the result or error is read after `done` is set."""

    def __init__(self, fn: Callable[..., Any], args: tuple, on_finish: Callable[[_Call], None]):
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple | None = args
        self.done = threading.Event()  # set by `on_finish`, under the guard's lock
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False  # set by the waiter, under the guard's lock
        self._on_finish = on_finish

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            self.error = e
        finally:
            self.fn = self.args = None  # a stuck call's arguments are freed when it ends
            self._on_finish(self)


class StoreGuard:
    """Deadlines, breakers and stuck-call accounting for one store. Thread-safe."""

    def __init__(self, cfg: GuardConfig = GuardConfig(), ratelog: RateLimitedLog | None = None):
        self.cfg = cfg
        self.breakers = {p: CircuitBreaker(cfg.breaker) for p in PATHS}
        self.ratelog = ratelog or RateLimitedLog(log)
        self._lock = threading.Lock()
        self._live = 0  # calls whose thread has not returned (the bound)
        self._stuck = 0  # of those, calls abandoned at their deadline
        self._closed = False  # after close: refuse new calls, stay quiet about old ones
        self.counters = Counters("calls", "timeouts", "errors", "refused", "breaker_trips")

    def available(self, path: str) -> bool:
        """False while `path`'s breaker is open (a half-open breaker admits a probe) or
        too many calls are stuck: a call now would be refused."""
        with self._lock:
            full = self._live >= self.cfg.max_calls
        return not full and self.breakers[path].state() != OPEN

    @property
    def stuck(self) -> int:
        with self._lock:
            return self._stuck

    def run(self, path: str, fn: Callable[..., T], *args: Any, what: str, timeout: float | None = None) -> T:
        """``fn(*args)`` within the deadline (default `cfg.timeout_s`), or raise `L3Timeout`,
        `L3Unavailable`, or what `fn` raised. `what` names the call in logs."""
        breaker = self.breakers[path]
        if self._closed:
            raise L3Unavailable("L3 client is closed")
        with self._lock:
            full = self._live >= self.cfg.max_calls
            if not full:
                self._live += 1  # reserved before the breaker: the bound is strict
        permit = None if full else breaker.allow()
        if permit is None:
            if not full:
                with self._lock:
                    self._live -= 1
            self.counters.add(refused=1)
            why = f"{self.stuck} calls stuck" if full else f"retry in {breaker.retry_in():.1f}s"
            raise L3Unavailable(f"L3 {path}s unavailable ({why})")
        self.counters.add(calls=1)
        call = _Call(fn, args, self._finished)
        threading.Thread(target=call.run, name=f"l3-{what}", daemon=True).start()
        limit = self.cfg.timeout_s if timeout is None else timeout
        if not call.done.wait(limit):
            with self._lock:
                if not call.done.is_set():
                    call.abandoned = True
                    self._stuck += 1
            if call.abandoned:
                self.counters.add(timeouts=1)
                err = L3Timeout(f"L3 {what} did not answer within {limit:g}s")
                self._failed(path, what, err, permit == "probe")
                raise err
        if call.error is not None:
            # A store with its own deadline (TensorStoreL3) raises TimeoutError itself.
            late = isinstance(call.error, TimeoutError)
            self.counters.add(timeouts=int(late), errors=int(not late))
            self._failed(path, what, call.error, permit == "probe")
            raise call.error
        if breaker.success():
            log.warning("L3 %ss work again: using L3 again", path)
        return call.result

    def _finished(self, call: _Call) -> None:
        with self._lock:
            call.done.set()
            self._live -= 1
            if call.abandoned:
                self._stuck -= 1

    def close(self) -> None:
        """Refuse every later call; calls still running end unlogged."""
        self._closed = True

    def _failed(self, path: str, what: str, err: BaseException, probe: bool) -> None:
        if self._closed:
            return
        breaker = self.breakers[path]
        if breaker.failure(probe=probe):
            if not probe:
                self.counters.add(breaker_trips=1)
            self.ratelog.warning(
                f"{path}-open",
                "L3 %ss unavailable after %s failed (%s: %s); serving without L3 %ss, next try in %.1fs",
                path,
                what,
                type(err).__name__,
                err,
                path,
                breaker.retry_in(),
            )
        else:
            self.ratelog.warning(f"{path}-error", "L3 %s failed: %s: %s", what, type(err).__name__, err)

    def health(self) -> Metrics:
        """Gauges: breakers not closed (1: open, or half-open waiting for a good probe) and
        calls stuck now."""
        out = Metrics().gauges({f"{p}_breaker_open": int(self.breakers[p].state() != CLOSED) for p in PATHS})
        return out.gauges({"stuck_calls": self.stuck})
