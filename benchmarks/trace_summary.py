"""Where a step's time goes, from a ``jax.profiler`` trace.

``top_ops(trace_dir, steps)`` reads the Perfetto trace that ``jax.profiler.start_trace(dir,
create_perfetto_trace=True)`` writes and sums the duration of each device op (XLA thunks on
CPU) by name, per step. Host-side Python frames and the runtime's own wrappers are left out.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

_WRAPPERS = ("ThunkExecutor", "PjitFunction", "PjRt", "Execute", "SlinkyThreadPool", "TaskDispatcher")


def top_ops(trace_dir: str, steps: int = 1, limit: int = 10) -> list[tuple[str, float, int]]:
    """(op name, ms per step, calls per step) for the ``limit`` most expensive ops."""
    pattern = os.path.join(trace_dir, "**", "*.json.gz")
    files = sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
    with gzip.open(files[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith("$") or any(w in name for w in _WRAPPERS):
            continue
        total[name] += e.get("dur", 0)
        calls[name] += 1
    return [(n, us / 1e3 / steps, calls[n] // steps) for n, us in total.most_common(limit)]
