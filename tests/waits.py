"""How long tests wait on this machine: one knob, ``HICACHE_TEST_TIMEOUT_SCALE``.

A test's time limits of its own kind (a server's start-up, an HTTP request to a test server,
a child process, a notebook cell) are sized for a loaded 2-core machine; on a slower or
busier one, ``HICACHE_TEST_TIMEOUT_SCALE=3 python -m pytest ...`` multiplies every one of
them. Deadlines a test checks (an L3 read deadline, "answers within a second") are the
behaviour under test and do not scale.
"""

from __future__ import annotations

import os

ENV = "HICACHE_TEST_TIMEOUT_SCALE"


def scale() -> float:
    value = os.environ.get(ENV, "1")
    try:
        factor = float(value)
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: give a number, e.g. 2") from None
    if factor <= 0:
        raise ValueError(f"{ENV}={value!r}: must be > 0")
    return factor


def wait(seconds: float) -> float:
    """``seconds`` (sized for a loaded 2-core machine) times the knob."""
    return seconds * scale()
