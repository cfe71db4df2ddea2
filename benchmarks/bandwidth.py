"""The memory-bandwidth yardstick every benchmark's floor divides by, measured in the run.

``copy_bandwidth()`` is bytes moved per second by a device copy (each byte read once and
written once, both counted). On CPU numpy's memcpy is tried as well and the faster wins,
so the floor is never flattered by a slow copy kernel.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    neg = jax.jit(lambda a: -a)  # a fresh buffer: one read and one write per byte
    best = _best(lambda: neg(x).block_until_ready(), repeats)
    if jax.default_backend() == "cpu":
        src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        best = min(best, _best(lambda: np.copyto(dst, src), repeats))
    return 2 * nbytes / best
