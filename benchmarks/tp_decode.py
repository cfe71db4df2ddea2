"""Decode step time at each tensor-parallel size, on emulated CPU devices.

    python benchmarks/tp_decode.py [--preset 100m] [--tp 1,2,4] [--batch 8] [--context 256]

Only a regression check: the devices are slices of the same CPU cores, so a larger
``tp_size`` adds collectives without adding compute, and the numbers say nothing about a
TPU. ``step ms`` is the median of timed engine decode steps (scheduling included), after
untimed steps that compile what the timed ones run; ``vs tp1`` divides by the first row.
"""

from __future__ import annotations

import os

_DEVICES = " --xla_force_host_platform_device_count=8"  # before JAX starts
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _DEVICES).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from hicache_jax.config import EngineConfig  # noqa: E402
from hicache_jax.engine.engine import Engine  # noqa: E402


def decode_ms(preset: str, tp: int, batch: int, context: int, steps: int) -> float:
    engine = Engine(
        EngineConfig(
            preset=preset,
            tp_size=tp,
            page_size=16,
            chunked_prefill_size=max(512, context),
            max_running_requests=batch,
            max_total_tokens=batch * (context + 2 * steps + 64) + 1024,
        )
    )
    rng = np.random.RandomState(0)
    for _ in range(batch):
        engine.add_request(
            input_ids=rng.randint(3, 500, context).tolist(),
            sampling_params={"max_new_tokens": 2 * steps + 16, "ignore_eos": True, "temperature": 0},
        )
    sched = engine.scheduler
    while sched.waiting or any(not r.output_ids for r in sched.running):
        engine.step()
    for _ in range(3):  # compiles the decode programs
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    print(f"{a.preset}: batch {a.batch}, context {a.context}, median of {a.steps} decode steps")
    print(f"{'tp_size':>8} {'step ms':>9} {'vs tp1':>7}")
    first = None
    for tp in (int(x) for x in a.tp.split(",")):
        ms = decode_ms(a.preset, tp, a.batch, a.context, a.steps)
        first = first or ms
        print(f"{tp:>8} {ms:>9.1f} {ms / first:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
