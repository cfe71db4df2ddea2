"""CircuitBreaker and RateLimitedLog on a fake clock."""

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.storage.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker
from hicache_jax.storage.ratelog import RateLimitedLog


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_opens_after_threshold_then_probes_with_growing_backoff():
    clock = Clock()
    b = CircuitBreaker(BreakerConfig(threshold=3, backoff_s=1.0, max_backoff_s=3.0), clock)
    assert [b.failure() for _ in range(3)] == [False, False, True]
    assert b.state() == OPEN and b.allow() is None and b.trips == 1
    clock.t += 1.0
    assert b.state() == HALF_OPEN
    assert b.allow() == "probe" and b.allow() is None  # one probe at a time
    assert b.failure() is False  # a straggler's failure says nothing new
    assert b.failure(probe=True) is True and b.retry_in() == 2.0  # backoff doubled
    clock.t += 2.0
    assert b.allow() == "probe" and b.failure(probe=True) and b.retry_in() == 3.0  # capped
    clock.t += 3.0
    assert b.allow() == "probe" and b.success() is True
    assert b.state() == CLOSED and b.allow() == "call" and b.trips == 1
    # Recovery resets the backoff and the failure count.
    assert [b.failure() for _ in range(3)] == [False, False, True] and b.retry_in() == 1.0


def test_success_between_failures_resets_the_count():
    b = CircuitBreaker(BreakerConfig(threshold=2), Clock())
    for _ in range(5):
        assert b.failure() is False
        assert b.success() is False
    assert b.state() == CLOSED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["allow", "ok", "fail", "tick", "wait"]), max_size=60))
def test_invariants_under_any_event_order(events):
    """Open refuses everything; half-open lets exactly one probe through until it reports;
    closed lets everything through; the backoff stays within its bounds."""
    clock = Clock()
    cfg = BreakerConfig(threshold=2, backoff_s=0.5, max_backoff_s=2.0)
    b = CircuitBreaker(cfg, clock)
    probe_out = False
    for e in events:
        state = b.state()
        if e == "allow":
            got = b.allow()
            if state == OPEN:
                assert got is None
            elif state == CLOSED:
                assert got == "call"
            else:
                assert got == ("probe" if not probe_out else None)
                probe_out = probe_out or got == "probe"
        elif e == "ok":
            b.success()
            probe_out = False
            assert b.state() == CLOSED
        elif e == "fail":
            b.failure(probe=probe_out)
            probe_out = False
        elif e == "tick":
            clock.t += 0.3
        else:
            clock.t += b.retry_in()
            assert b.state() != OPEN
        assert 0.0 <= b.retry_in() <= cfg.max_backoff_s


def test_rate_limited_log_bounds_lines_and_counts_the_rest(caplog):
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("test.ratelog"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        sent = [rl.warning("disk", "page %d failed", i) for i in range(1000)]
        clock.t += 10.0
        rl.warning("disk", "page %d failed", 1000)
        rl.warning("other", "another topic")
    assert sum(sent) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["page 0 failed", "page 1000 failed (+999 more suppressed)", "another topic"]
