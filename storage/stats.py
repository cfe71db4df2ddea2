"""Thread-safe integer counters shared by the L3 store and the storage client."""

from __future__ import annotations

import threading

from hicache_jax.metric_kinds import Metrics


class Counters:
    """A fixed set of named integer counters; `add` and `snapshot` are thread-safe.

    Invariant: the set of names is fixed at construction, so a typo fails loudly.
    """

    def __init__(self, *names: str):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown counter {name!r}")
                self._values[name] += delta

    def snapshot(self) -> Metrics:
        """The values, declared counters."""
        with self._lock:
            return Metrics().counters(self._values)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values[name]
