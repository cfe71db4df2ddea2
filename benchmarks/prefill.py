"""Prefill step time against the compute floor.

    python benchmarks/prefill.py [--preset 100m] [--prompt 4096] [--prefix 2048] [--new 32]

Two steps are timed (the runner's forward and sampling, compiled beforehand by an
identical step):

- cold: a ``--prompt``-token prompt, prefilled in one step;
- continuation: the first ``--prefix`` tokens of that prompt sit in the device prefix cache
  (L1) from the cold request; a new request brings them plus ``--new`` tokens, and the step
  that prefills those tokens is timed. It should cost about ``--new`` tokens' worth of
  matmuls plus their attention over the cached context, not a long chunk's worth.

The floor is the step's FLOPs over the float32 matmul rate measured in the same run
(``floors.matmul_rate``, shared with decode.py). FLOPs are counted twice: analytically (the real tokens'
matmuls, the logits of the sampled rows, and each token's attention over the keys it
sees), and by XLA's ``cost_analysis`` of the compiled step (the padded shapes; it counts
a ``while`` loop's body once, so the attention loops' trip counts are missing).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from floors import matmul_rate, step_flops  # benchmarks/ is the script's directory

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine


class TimedRunner:
    """Wraps ``runner.launch`` and waits for the step: the wall time and inputs of each call."""

    def __init__(self, runner):
        self.runner, self.launch, self.calls = runner, runner.launch, []

    def __call__(self, *inputs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.launch(*inputs))
        self.calls.append((time.perf_counter() - t0, inputs[0]))
        return out


def prefill(engine: Engine, timer: TimedRunner, ids: list[int]) -> tuple[float, tuple, int]:
    """Serve ``ids`` (one output token); the seconds of its (single) prefill step."""
    rid = engine.add_request(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    req = engine.requests[rid]
    timer.calls.clear()
    while engine.has_unfinished():
        engine.step()
    if len(timer.calls) != 1:
        raise RuntimeError(f"the prefill took {len(timer.calls)} steps, not one")
    seconds, inputs = timer.calls[0]
    return seconds, inputs, req.cached_tokens


def compiled_flops(engine: Engine, inputs: tuple) -> float:
    runner = engine.runner
    cost = runner.lower_step(inputs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def report(name: str, seconds: float, new: int, cached: int, inputs: tuple, engine: Engine, rate: float):
    batch = inputs.batch
    T, S = batch.input_ids.shape[0], batch.kv_lens.shape[0]
    analytic = step_flops(engine.model.cfg, [(new, cached + new)])
    compiled = compiled_flops(engine, inputs)
    floor = analytic / rate
    print(
        f"{name:<13} {new:>5} new + {cached:>5} cached (step T={T}, S={S}): {seconds * 1e3:9.1f} ms, "
        f"{new / seconds:8.1f} tok/s; analytic {analytic / 1e9:7.2f} GFLOP (floor {floor * 1e3:8.1f} ms, "
        f"{seconds / floor:4.2f}x), cost_analysis {compiled / 1e9:7.2f} GFLOP"
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="100m")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args()
    if args.prefix > args.prompt or args.prefix % 16:
        raise SystemExit("--prefix must be a multiple of the page size (16) and <= --prompt")
    engine = Engine(
        EngineConfig(
            preset=args.preset,
            page_size=16,
            chunked_prefill_size=args.prompt,
            max_total_tokens=4 * args.prompt + 4096,
        )
    )
    timer = TimedRunner(engine.runner)
    engine.runner.launch = timer
    rate = matmul_rate()
    print(f"device: {jax.devices()[0].device_kind}; float32 matmul {rate / 1e9:.1f} GFLOP/s")
    rng = np.random.default_rng(0)

    def tokens(n):
        return rng.integers(3, engine.model.cfg.vocab_size, n).tolist()

    prefill(engine, timer, tokens(args.prompt))  # compiles the cold step's shape
    prompt = tokens(args.prompt)
    seconds, inputs, cached = prefill(engine, timer, prompt)
    report("cold", seconds, args.prompt, cached, inputs, engine, rate)

    prefix = prompt[: args.prefix]
    prefill(engine, timer, prefix + tokens(args.new))  # compiles the continuation's shape
    best = None
    for _ in range(3):
        seconds, inputs, cached = prefill(engine, timer, prefix + tokens(args.new))
        if cached != args.prefix:
            raise RuntimeError(f"the continuation found {cached} cached tokens, not {args.prefix}")
        best = min(best or (seconds, inputs), (seconds, inputs), key=lambda x: x[0])
    report("continuation", best[0], args.new, args.prefix, best[1], engine, rate)
    engine.close()


if __name__ == "__main__":
    main()
