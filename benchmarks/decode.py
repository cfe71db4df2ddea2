"""Decode throughput and step time against the memory and compute floors.

    python benchmarks/decode.py [--presets tiny,100m] [--batches 1,8,32,64] [--context 256]
                                [--profile_dir DIR]

For each preset and batch size: B requests with a ``--context``-token prompt are prefilled,
then decode steps are timed through the engine (scheduling included) and through the
runner alone. Two floors, both from yardsticks measured in the same run:

- memory: the bytes a step must read (weights, plus each sequence's KV: the whole context
  for full-attention layers, the window for sliding ones, plus Mamba states read and
  written; for DeepSeek V4 each pool's rows a query reads, ``dsv4_bytes``) over the copy
  bandwidth (benchmarks/bandwidth.py). Of a mixture-of-experts
  layer only the experts the step's tokens route to count: ``E (1 - (1 - k/E)^B)`` of them
  at batch B, as expected under uniform routing;
- compute: the step's FLOPs (benchmarks/floors.py) over the best float32 matmul rate; for
  MoE, the active parameters only (router and top_k experts per token).

``--moe_split`` times one MoE layer of the preset at each batch alone: the whole grouped
path (route, sort, two ragged matmuls, combine) against its two ragged matmuls on rows
already sorted, so ``dispatch = whole - matmuls`` is the routing and data movement.

``engine ms`` is a step with the overlap schedule (the host plans step N+1 while the device
runs step N), ``no-overlap`` the same engine reading each step before planning the next.
``ratio`` is the engine step over the larger floor. ``--profile_dir`` captures a
``jax.profiler`` trace of a few engine steps per row and prints the ops that dominate.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import jax
import numpy as np
from bandwidth import copy_bandwidth  # benchmarks/ is the script's directory
from floors import matmul_rate, step_flops
from trace_summary import top_ops

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.kinds import CacheKind
from hicache_jax.models.cache import PAGE_ROW, RecurrentState, paged_specs
from hicache_jax.models.presets import preset_config


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens route to, expected under uniform routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def dsv4_bytes(cfg, kind: str, dtype_bytes: int, context: int) -> int:
    """Bytes one sequence's decode step at ``context`` reads from a DeepSeek V4 layer's pools
    (``models/cache.py``, ``_dsv4_specs``): the window's rows; a CSA layer's ``index_topk``
    picked entries and every visible indexer key (all scored), an HCA layer's every visible
    entry; a compressed layer's float32 compressor state, read before the step and written
    after it."""
    out = 0
    for s in paged_specs(cfg, kind):
        row = len(s.entry._fields) * math.prod(s.per_row) * s.value_bytes(dtype_bytes)
        if s.kind == CacheKind.SWA:
            rows = min(context, cfg.sliding_window)
        elif s.rate == PAGE_ROW:
            rows = 2
        else:
            visible = context // s.rate
            rows = min(visible, cfg.dsv4.index_topk) if s.kind == CacheKind.CSA else visible
        out += rows * row
    return out


def step_bytes(engine: Engine, batch: int, context: int) -> int:
    cfg = engine.model.cfg
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(engine.runner.params))
    if cfg.moe is not None:  # a step reads only the experts its tokens route to
        m, itemsize = cfg.moe, engine.model.dtype.itemsize
        first = cfg.sparse_layers[0]
        per_expert = (cfg.mlp_params(first) - cfg.mlp_params(first, active=True)) / (m.num_experts - m.top_k)
        untouched = m.num_experts - experts_touched(m.num_experts, m.top_k, batch)
        weights -= int(len(cfg.sparse_layers) * untouched * per_expert * itemsize)
    if cfg.dsv4 is not None:  # a hash layer reads its tid2eid rows of the step's tokens only
        weights -= len(cfg.dsv4.hash_layers) * (cfg.vocab_size - batch) * cfg.moe.top_k * 4
    kv = 0
    for kind, entry in zip(cfg.layer_kinds, engine.runner.cache):
        if kind in ("swa_mqa", "csa", "hca"):
            kv += batch * dsv4_bytes(cfg, kind, jax.tree_util.tree_leaves(entry)[0].dtype.itemsize, context)
        elif isinstance(entry, RecurrentState):
            kv += 2 * batch * (entry.ssm[0].nbytes + entry.conv[0].nbytes)  # read + write
        else:
            per_token = sum(a[0, 0].nbytes for a in jax.tree_util.tree_leaves(entry))  # K and V, or a latent
            span = min(context, cfg.sliding_window) if kind == "sliding" else context
            kv += batch * span * per_token
    return weights + kv


def bench(
    preset: str, batch: int, context: int, steps: int, bandwidth: float, rate: float, profile_dir: str = ""
) -> dict:
    page = max(16, preset_config(preset).page_multiple)  # DeepSeek V4: pages hold whole entries
    engine = Engine(
        EngineConfig(
            preset=preset,
            page_size=page,
            chunked_prefill_size=-(-max(512, context) // page) * page,
            max_running_requests=max(batch, 1),
            max_total_tokens=batch * (context + 6 * steps + batch + 64 + page) + 1024,
            warmup=False,  # the steps before timing compile what the timed ones run
        )
    )
    rng = np.random.RandomState(0)
    for _ in range(batch):
        engine.add_request(
            input_ids=rng.randint(3, 500, context).tolist(),
            # Long enough that nobody finishes (and shrinks the batch) while we time.
            sampling_params={"max_new_tokens": 6 * steps + batch + 16, "ignore_eos": True, "temperature": 0},
        )
    sched = engine.scheduler
    while sched.waiting or any(r.remaining > 1 or not r.output_ids for r in sched.running):
        engine.step()
    compiled = engine.runner.num_compiled()
    for _ in range(3):
        engine.step()
    # The same engine with and without the overlap schedule, alternated; best of two each.
    timed = {True: [], False: []}
    for _ in range(2):
        for overlap in (True, False):
            engine.cfg = dataclasses.replace(engine.cfg, disable_overlap_schedule=not overlap)
            engine.step()  # the switch itself (the first step after it cannot look ahead)
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            timed[overlap].append((time.perf_counter() - t0) / steps)
    engine.cfg = dataclasses.replace(engine.cfg, disable_overlap_schedule=False)
    engine_step, serial_step = min(timed[True]), min(timed[False])
    assert engine.runner.num_compiled() == compiled, "a compile inside the timed steps"
    assert len(engine.scheduler.running) == batch
    # The runner alone, on the same decode batch shape.
    engine.sync()
    plan = engine.scheduler.schedule()
    inputs = engine.builder.build(plan)
    engine.runner.step(inputs)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.runner.step(inputs)
    runner_step = (time.perf_counter() - t0) / steps
    mid = context + 3 * steps  # the context halfway through the timed steps, roughly
    mem = step_bytes(engine, batch, mid) / bandwidth
    compute = step_flops(engine.model.cfg, [(1, mid)] * batch) / rate
    if profile_dir:
        trace = f"{profile_dir}/{preset}-b{batch}"
        jax.profiler.start_trace(trace, create_perfetto_trace=True)
        for _ in range(3):
            engine.step()
        jax.profiler.stop_trace()
        print(f"  {preset} B={batch}: ops per engine step (ms) from {trace}")
        for name, ms, n in top_ops(trace, steps=3, limit=8):
            print(f"    {ms:8.2f}  x{n:<4d} {name}")
    return {
        "preset": preset,
        "batch": batch,
        "tokens_per_s": batch / engine_step,
        "engine_step_ms": 1e3 * engine_step,
        "serial_step_ms": 1e3 * serial_step,
        "runner_step_ms": 1e3 * runner_step,
        "mem_floor_ms": 1e3 * mem,
        "compute_floor_ms": 1e3 * compute,
        "ratio": engine_step / max(mem, compute),
    }


def moe_split(preset: str, batch: int, repeats: int = 50) -> dict:
    """One MoE layer of ``preset`` on ``batch`` tokens, on this platform's path
    (``KernelConfig.moe_path``): the whole layer, and its two expert matmuls alone on
    inputs already laid out for them (rows sorted by expert for ``grouped``; each
    assignment's expert, or every expert, for ``gathered``)."""
    import jax.numpy as jnp
    from flax import nnx

    from hicache_jax.models.kernels.backend import KernelConfig
    from hicache_jax.models.layers.moe import MoE, expert_activation, route
    from hicache_jax.models.presets import preset_config

    cfg = preset_config(preset)
    m, path = cfg.moe, KernelConfig().moe_path
    layer = MoE(cfg.hidden_size, m, dtype=jnp.float32, rngs=nnx.Rngs(0), path=path)
    x = jax.random.normal(jax.random.key(1), (batch, cfg.hidden_size), jnp.float32)
    weights, experts = route(layer.router(x), m)
    gate_up, down = layer.gate_up[...], layer.down[...]
    hi = jax.lax.Precision.HIGHEST
    flat = experts.reshape(-1)
    if path == "grouped":
        rows = x[jnp.argsort(flat, stable=True) // m.top_k]
        sizes = jnp.bincount(flat, length=m.num_experts).astype(jnp.int32)

        def matmuls(rows, gate_up, down):
            h = expert_activation(jax.lax.ragged_dot(rows, gate_up, sizes, precision=hi), m)
            return jax.lax.ragged_dot(h, down, sizes, precision=hi)

    elif batch * m.top_k < m.num_experts:
        rows = jnp.repeat(x, m.top_k, axis=0)

        def matmuls(rows, gate_up, down):
            h = expert_activation(jnp.einsum("ah,ahf->af", rows, gate_up[flat], precision=hi), m)
            return jnp.einsum("ai,aih->ah", h, down[flat], precision=hi)

    else:
        rows = jnp.broadcast_to(x[None], (m.num_experts,) + x.shape)

        def matmuls(rows, gate_up, down):
            h = expert_activation(jnp.einsum("eth,ehf->etf", rows, gate_up, precision=hi), m)
            return jnp.einsum("eti,eih->eth", h, down, precision=hi)

    graphdef, state = nnx.split(layer)
    whole = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))

    def best(f, *a) -> float:
        f(*a).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(*a).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    # Weights as arguments, as in a serving step (as closure constants XLA would fold
    # their relayouts away).
    t_whole, t_matmuls = best(whole, state, x), best(jax.jit(matmuls), rows, gate_up, down)
    dispatch = t_whole - t_matmuls
    ms = {"whole_ms": 1e3 * t_whole, "matmuls_ms": 1e3 * t_matmuls, "dispatch_ms": 1e3 * dispatch}
    return {"path": path, **ms}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="tiny,100m")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--profile_dir", default="", help="capture a jax.profiler trace per row here")
    p.add_argument("--moe_split", action="store_true", help="time an MoE layer's dispatch vs its matmuls")
    args = p.parse_args()
    if args.moe_split:
        for preset in args.presets.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                r = moe_split(preset, b)
                print(
                    f"{preset} B={b} ({r['path']}): MoE layer {r['whole_ms']:.3f} ms, "
                    f"its expert matmuls {r['matmuls_ms']:.3f} ms, dispatch {r['dispatch_ms']:.3f} ms "
                    f"({r['dispatch_ms'] / r['matmuls_ms']:.2f}x the matmuls)"
                )
        return
    bw, rate = copy_bandwidth(), matmul_rate()
    print(
        f"device: {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e9:.2f} GB/s (read + write); "
        f"matmul {rate / 1e9:.1f} GFLOP/s (float32)"
    )
    cols = ("preset", "B", "tok/s", "engine ms", "no-overlap", "runner ms", "mem ms", "flop ms", "ratio")
    print(" ".join(f"{c:>{w}}" for c, w in zip(cols, (8, 3, 9, 10, 10, 10, 9, 9, 7))))
    for preset in args.presets.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            r = bench(preset, b, args.context, args.steps, bw, rate, args.profile_dir)
            print(
                f"{preset:>8} {b:>3} {r['tokens_per_s']:>9.1f} {r['engine_step_ms']:>10.2f} "
                f"{r['serial_step_ms']:>10.2f} {r['runner_step_ms']:>10.2f} {r['mem_floor_ms']:>9.3f} "
                f"{r['compute_floor_ms']:>9.3f} {r['ratio']:>7.1f}"
            )


if __name__ == "__main__":
    main()
