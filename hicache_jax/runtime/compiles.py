"""Counts XLA compilations in this process, through JAX's public monitoring events.

JAX records ``/jax/core/compile/backend_compile_duration`` (with the program's name, e.g.
``jit(_step)``) for every program it hands to the backend compiler, jitted functions and
eager ``jnp`` operations alike, and for programs loaded from the persistent compilation
cache. One listener, registered on import, counts them by name; another counts the loads
from that cache (``/jax/compilation_cache/cache_hits``), so that compiled and loaded can be
told apart.
"""

from __future__ import annotations

import collections
import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()
_seconds = [0.0]
_loaded = [0]


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
        with _lock:
            _counts[str(kwargs.get("fun_name", "?"))] += 1
            _seconds[0] += duration


def _on_cache_hit(event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
        with _lock:
            _loaded[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)
jax.monitoring.register_event_listener(_on_cache_hit)


def snapshot() -> collections.Counter[str]:
    """Programs compiled so far in this process, by name."""
    with _lock:
        return collections.Counter(_counts)


def total(name: str | None = None) -> int:
    """Compilations so far (of programs called ``name``, or of all)."""
    with _lock:
        return _counts[name] if name else sum(_counts.values())


def loaded() -> int:
    """Programs loaded from JAX's persistent compilation cache so far (each also counts in
    ``total``)."""
    with _lock:
        return _loaded[0]


def seconds() -> float:
    """Backend compile time so far (summed over threads)."""
    with _lock:
        return _seconds[0]


class Watch:
    """``with Watch() as w: ...`` then ``w.new``: what was compiled inside the block."""

    def __enter__(self) -> Watch:
        self._before = snapshot()
        self.new: collections.Counter[str] = collections.Counter()
        return self

    def __exit__(self, *exc) -> None:
        self.new = snapshot() - self._before
