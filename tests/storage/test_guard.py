"""StoreGuard: deadlines on calls that hang in Python, a strict bound on live calls, breakers per path."""

import threading
import time

import pytest

from hicache_jax.storage.breaker import BreakerConfig
from hicache_jax.storage.guard import GuardConfig, L3Timeout, L3Unavailable, StoreGuard


def _guard(**kw):
    cfg = dict(timeout_s=0.1, max_calls=2, breaker=BreakerConfig(threshold=2, backoff_s=0.2))
    return StoreGuard(GuardConfig(**(cfg | kw)))


def test_result_and_error_pass_through():
    g = _guard()
    assert g.run("read", lambda x: x + 1, 1, what="add") == 2
    with pytest.raises(OSError, match="boom"):
        g.run("read", lambda: (_ for _ in ()).throw(OSError("boom")), what="fail")
    stats = g.counters.snapshot()
    assert stats["calls"] == 2 and stats["errors"] == 1


def test_hung_call_times_out_and_stuck_calls_are_bounded():
    g = _guard(breaker=BreakerConfig(threshold=100))
    gate = threading.Event()
    started = []

    def hang():
        started.append(1)
        gate.wait()

    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(L3Timeout):
            g.run("read", hang, what="hang")
        assert time.monotonic() - t0 < 0.5
    assert g.stuck == 2
    # Two calls are alive (stuck): the third is refused without starting a thread.
    with pytest.raises(L3Unavailable, match="stuck"):
        g.run("write", hang, what="hang")
    assert len(started) == 2 and g.counters["refused"] == 1
    gate.set()
    deadline = time.monotonic() + 5
    while g.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.stuck == 0 and g.run("read", lambda: "ok", what="ok") == "ok"


def test_breakers_are_per_path_and_recover_through_a_probe():
    g = _guard()

    def fail():
        raise PermissionError("denied")

    for _ in range(2):
        with pytest.raises(PermissionError):
            g.run("write", fail, what="put")
    assert g.health() == {"read_breaker_open": 0, "write_breaker_open": 1, "stuck_calls": 0}
    assert g.run("read", lambda: 1, what="get") == 1  # reads still go
    calls = []
    with pytest.raises(L3Unavailable):
        g.run("write", calls.append, 1, what="put")
    assert calls == [] and g.counters["breaker_trips"] == 1
    time.sleep(0.25)  # the backoff: the next call is a probe
    assert g.run("write", calls.append, 2, what="put") is None and calls == [2]
    assert g.health()["write_breaker_open"] == 0
