"""Warm-up: compile every program serving can run, before the first request.

Serving runs two families of programs, each over a bounded set of shapes:

- the step (``runtime/runner.py``): one program per ``BatchBuilder.warmup_programs()`` entry
  (decode and prefill buckets, per-token logits rows for input logprobs, with and without
  top logprobs); recurrent state copies and penalty counts run inside it;
- a penalty slot's row write (``runtime/penalties.py``), when a request with a penalty starts;
- page transfers (``runtime/transfer.py``, with a host tier): a gather (device -> host: backups)
  and a scatter (host -> device: L2 hits, and L3 hits, which land in the host pool first)
  per page kind and chunk bucket.

Nothing else touches the device while serving. Programs are lowered one at a time
(tracing holds the GIL) and compiled on a thread pool (the backend compiler releases it);
the jits' call paths then find them compiled. Nothing is executed, so warm-up reads and
writes no cache page.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time

import jax

from hicache_jax import progress
from hicache_jax.runtime import compiles
from hicache_jax.runtime.batch_builder import BatchBuilder
from hicache_jax.runtime.runner import ModelRunner, step_name
from hicache_jax.runtime.transfer import PageTransfer
from hicache_jax.scheduler.plan import StepPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    programs: int  # programs warm-up asked for
    compiled: int  # of them, compiled now
    seconds: float
    loaded: int = 0  # of them, loaded from the persistent compilation cache (the rest of
    # ``programs`` were compiled or loaded before, in this process)


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def warmup(
    runner: ModelRunner,
    builder: BatchBuilder,
    transfer: PageTransfer | None = None,
    *,
    workers: int | None = None,
) -> WarmupReport:
    t0 = time.perf_counter()
    before, loaded_before = compiles.total(), compiles.loaded()
    with (
        concurrent.futures.ThreadPoolExecutor(workers or default_workers()) as pool,
        progress.bar(desc="warm-up compiles", unit="program") as shown,
    ):
        futures = {}
        for name, lowered in programs(runner, builder, transfer):
            futures[pool.submit(lowered.compile)] = name
            shown.total = len(futures)  # grows while programs are lowered; advances as they compile
            shown.refresh()
        for f in concurrent.futures.as_completed(futures):
            shown.set_postfix_str(futures[f], refresh=False)
            shown.update()
            try:
                f.result()
            except Exception as e:
                raise RuntimeError(f"warm-up: compiling {futures[f]} failed: {e}") from e
    loaded = compiles.loaded() - loaded_before  # each also counts in compiles.total()
    report = WarmupReport(
        programs=len(futures),
        compiled=compiles.total() - before - loaded,
        seconds=time.perf_counter() - t0,
        loaded=loaded,
    )
    log.info(
        "warm-up: %d programs in %.1fs (%d compiled, %d loaded from the compilation cache)",
        report.programs,
        report.seconds,
        report.compiled,
        report.loaded,
    )
    return report


def programs(runner: ModelRunner, builder: BatchBuilder, transfer: PageTransfer | None):
    """(name, lowered program) for every program serving can run, lowered lazily."""
    for name, lower in lowerings(runner, builder, transfer):
        yield name, lower()


def lowerings(runner: ModelRunner, builder: BatchBuilder, transfer: PageTransfer | None):
    """(name, a function that lowers it) for every program serving can run."""
    layerwise = transfer is not None and transfer.step_pages > 0
    for shape, top in builder.warmup_programs():
        name = step_name(shape, top)
        yield name, functools.partial(lower_step, runner, builder, shape, top)
        if (
            layerwise and not shape.decode_only and not shape.verify
        ):  # a prefill may take L2 pages layer by layer
            loads = functools.partial(lower_step, runner, builder, shape, top, transfer)
            yield f"{name} +{transfer.step_pages} pages layer by layer", loads
    yield "penalty row write", runner.lower_penalty_row
    if transfer is not None:
        yield from transfer.lowerings()


def lower_step(
    runner: ModelRunner, builder: BatchBuilder, shape, top: int, transfer: PageTransfer | None = None
) -> jax.stages.Lowered:
    """The step program for a ``StepShape``, lowered on an empty batch; with ``transfer``,
    the variant that takes its L2 pages layer by layer."""
    loads = transfer.empty_step_loads() if transfer is not None else None
    inputs = builder.build(StepPlan(items=[]), shape, loads=loads)
    return runner.lower_step(dataclasses.replace(inputs, top_logprobs=top))
