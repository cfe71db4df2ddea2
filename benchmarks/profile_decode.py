"""Where a decode step's device time goes, by named scope (attention, kv_write, mlp, mamba,
sampling): a ``jax.profiler`` trace of a few decode steps, taken as ``POST /start_profile``
takes it (``hicache_jax/server/profiler.py``).

    python benchmarks/profile_decode.py [--preset tiny] [--requests 8] [--steps 3]

On CPU the trace names each device op by its HLO instruction (``sort.0``,
``broadcast_add_fusion.1``); the step program's compiled HLO maps each name to the
``jax.named_scope`` path it came from. The step program is the one the last timed step ran
(its argument shapes are recorded on the way in).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time

import jax

import hicache_jax.runtime.runner as runner_mod
from hicache_jax import LLM
from hicache_jax.server.profiler import Profiler

SCOPES = ("kv_write", "attention", "mlp", "mamba", "sampling")  # innermost first


def scope_of(op_name: str) -> str:
    parts = op_name.split("/")
    return next((s for s in SCOPES if s in parts), "other")


def op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its scope, from the ``op_name`` metadata."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*op_name=\"([^\"]*)\"", line)
        if m:
            out[m.group(1)] = scope_of(m.group(2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    n = args.requests
    llm = LLM(preset=args.preset, max_total_tokens=8192, context_length=1024, max_running_requests=n)
    sp = {"max_new_tokens": 4 + 2 * args.steps, "temperature": 0, "ignore_eos": True}
    llm.generate(prompts=[f"hello world {i} " * 8 for i in range(n)], sampling_params=sp)  # compiles
    step_jit, seen = runner_mod._step_jit, {}

    def recording(*a, **k):
        seen["args"] = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, a
        )
        seen["kwargs"] = k
        return step_jit(*a, **k)

    runner_mod._step_jit = recording
    engine = llm.engine
    for i in range(n):
        engine.add_request(text=f"hello world {i} " * 8, sampling_params=sp)
    for _ in range(3):
        engine.step()  # the prefill, and decodes until the overlap schedule is steady
    profiler, walls = Profiler(), []
    profiler.start(tempfile.mkdtemp(prefix="profile_decode_"))
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    trace = profiler.stop()
    runner_mod._step_jit = step_jit
    names = op_scopes(step_jit.lower(*seen["args"], **seen["kwargs"]).compile().as_text())
    perfetto = next(f for f in trace["files"] if f.endswith("perfetto_trace.json.gz"))
    with gzip.open(perfetto) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("name") in names]
    by = collections.defaultdict(float)
    for e in events:
        by[names[e["name"]]] += e["dur"] / 1e3
    device = sum(by.values())
    print(
        f"{args.preset}, {n} requests, {args.steps} decode steps: wall ms per step",
        [round(w * 1e3, 2) for w in walls],
    )
    print(f"device time {device / args.steps:.3f} ms per step; trace in {trace['output_dir']}")
    for scope, ms in sorted(by.items(), key=lambda kv: -kv[1]):
        print(f"  {scope:10s} {ms / args.steps:8.3f} ms/step  {100 * ms / max(device, 1e-9):5.1f}%")


if __name__ == "__main__":
    main()
