"""Several processes (hosts), one mesh: ``jax.distributed`` set-up and the per-step plan check.

Every process runs the same step on its slice of the mesh, so every process must plan the
same step: the same batch, the same cache pages, the same sampling seeds. A process that
plans differently would launch a different program, and the collectives of the two would
wait on each other forever. So before each step the processes exchange a digest of the
step's inputs (one small all-gather) and stop with ``PlanDivergence``, naming the step and
the processes that differ, instead of hanging.

On CPU the collectives go through gloo (``jax_cpu_collectives_implementation``), which is
how the tests run two processes of 4 emulated devices each on one machine.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import numpy as np

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.engine.failures import EngineLost


class PlanDivergence(EngineLost):
    """The processes planned different steps; their device programs would deadlock."""


def initialize(cfg: EngineConfig) -> None:
    """Join the other processes (before anything touches a JAX backend); no-op for one.
    ``cfg.dist_*`` are validated by ``EngineConfig``."""
    if cfg.dist_num_processes == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cfg.dist_coordinator,
        num_processes=cfg.dist_num_processes,
        process_id=cfg.dist_process_id,
    )


def digest(tree) -> bytes:
    """SHA-256 over every leaf's shape, dtype and bytes (host arrays; device arrays are
    read back, so pass the host-side plan)."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()


def check_same_plan(step: int, plan_digest: bytes) -> None:
    """All-gather every process's digest of step ``step``; raise ``PlanDivergence`` on a
    mismatch (on every process, since each sees all digests)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = np.frombuffer(plan_digest[:16], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    differ = [p for p in range(len(every)) if (every[p] != every[0]).any()]
    if differ:
        raise PlanDivergence(
            f"step {step}: processes {differ} planned a different step from process 0 "
            f"(digests {[row.tobytes().hex()[:12] for row in every]}); stopping instead of "
            "launching programs whose collectives would never meet"
        )


def check_plan(step: int, plan) -> None:
    """``ModelRunner``'s per-step ``check_plan`` over several processes: the digest of step
    ``step``'s host-side inputs, which must be the same on every process."""
    check_same_plan(step, digest(plan))


def check_same_config(cfg: EngineConfig) -> None:
    """Every process must run the same engine config (all but ``dist_process_id``): a
    different seed, pool size or policy on one host plans different steps. Compares one
    hash per field across processes and raises ``ConfigError`` naming the fields that
    differ, at start-up rather than at the first step they would change."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = [f.name for f in dataclasses.fields(cfg) if f.name != "dist_process_id"]
    hashes = [hashlib.sha256(repr(getattr(cfg, n)).encode()).digest()[:4] for n in names]
    mine = np.array([int.from_bytes(h, "little") for h in hashes], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), len(names))
    differ = [n for i, n in enumerate(names) if (every[:, i] != every[0, i]).any()]
    if differ:
        raise ConfigError(
            f"process {jax.process_index()}: the processes were started with different settings for "
            f"{', '.join(differ)}; every process must get the same flags (only --dist_process_id differs)"
        )
