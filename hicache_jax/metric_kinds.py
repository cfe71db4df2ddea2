"""Numbers a component reports, each declared a counter or a gauge where it is produced.

``/metrics`` exports a counter (a number that only grows: steps, tokens, errors) as a
Prometheus counter and anything that goes up and down (queue lengths, pool use, breaker
states) as a gauge. The kind is declared beside the value, so the exporter never guesses it
from the name::

    out = Metrics().counters({"steps": 0}).gauges({"num_running_reqs": 2})
    out.add(storage.stats(), prefix="l3_")  # the kinds travel with the numbers

A ``Metrics`` is a plain ``dict`` of numbers to everyone else (``/get_server_info``, tests).
Keys set by item assignment keep the kind they were declared with; a key never declared
shows up in ``undeclared()`` (the exporter refuses it).
"""

from __future__ import annotations

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAMS = "histograms"  # a dict of named histograms (``server/latency.py``'s snapshots)
KINDS = (COUNTER, GAUGE, HISTOGRAMS)


class Metrics(dict):
    def __init__(self):
        super().__init__()
        self.kinds: dict[str, str] = {}

    def counters(self, values: dict) -> Metrics:
        """Add numbers that only grow."""
        return self._declare(COUNTER, values)

    def gauges(self, values: dict) -> Metrics:
        """Add numbers that go up and down."""
        return self._declare(GAUGE, values)

    def histograms(self, values: dict) -> Metrics:
        """Add a dict of histogram snapshots under each key."""
        return self._declare(HISTOGRAMS, values)

    def add(self, other: Metrics, prefix: str = "") -> Metrics:
        """Add another component's numbers with their kinds, keys prefixed."""
        for key, value in other.items():
            self[prefix + key] = value
            if key in getattr(other, "kinds", {}):
                self.kinds[prefix + key] = other.kinds[key]
        return self

    def copy(self) -> Metrics:
        return Metrics().add(self)

    def undeclared(self) -> list[str]:
        """Keys whose kind nobody declared."""
        return sorted(k for k in self if k not in self.kinds)

    def _declare(self, kind: str, values: dict) -> Metrics:
        self.update(values)
        self.kinds.update(dict.fromkeys(values, kind))
        return self
