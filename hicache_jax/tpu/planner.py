"""What one engine configuration needs of each chip of a TPU slice, from its compiled programs.

Memory per chip comes from the compiled serving programs (``memory_analysis``): weights and
the device cache are the programs' arguments (exact, from their shards), temporaries the
largest any program needs. The largest pool that fits follows from the free bytes and the
pool's bytes per token, and is checked by compiling the largest-temporaries program at it.

Per-step cost comes from the compiled step: flops from ``cost_analysis``, HBM bytes from
its scheduled HLO as they lie in HBM (``hbm.py``; the Pallas kernels report both through
``pl.CostEstimate``), and the roofline time
``max(flops / peak, bytes / bandwidth)`` with the chip's published peak and bandwidth.
Decode steps are costed with every sequence at ``decode_context`` tokens (the kernels'
estimates count the pages a sequence of that length reads).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp

from hicache_jax.config import EngineConfig
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.page_bytes import read_bytes_per_token
from hicache_jax.tpu.abstract import AbstractServer
from hicache_jax.tpu.hbm import hbm_bytes
from hicache_jax.tpu.target import TpuTarget, abstract, compile_for

GiB = 2**30
DECODE_BATCHES = (1, 8, 64)


class DoesNotFit(Exception):
    """The configuration needs more HBM per chip than the chip has; the message says how much."""


@dataclasses.dataclass(frozen=True)
class StepCost:
    name: str
    tokens: int  # tokens the step produces (decode) or prefills
    flops: float
    hbm_bytes: float
    roofline_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.roofline_s if self.roofline_s else 0.0


@dataclasses.dataclass(frozen=True)
class Plan:
    topology: str
    tp_size: int
    hbm_bytes: int  # usable per chip, as the compiler counts it
    weights_bytes: int
    kv_pool_bytes: int  # attention pages
    state_bytes: int  # recurrent state slots
    temp_bytes: int
    temp_program: str
    max_total_tokens: int  # the configuration's
    max_total_tokens_that_fit: int
    fit_confirmed: bool  # a compile at max_total_tokens_that_fit fitted HBM
    state_slots: int
    state_slots_that_fit: int | None
    steps: tuple[StepCost, ...]
    l3_read_bytes_per_token: float

    @property
    def free_bytes(self) -> int:
        return self.hbm_bytes - self.weights_bytes - self.kv_pool_bytes - self.state_bytes - self.temp_bytes

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["free_bytes"] = self.free_bytes
        d["steps"] = {s.name: dict(dataclasses.asdict(s), tokens_per_s=s.tokens_per_s) for s in self.steps}
        return d


@functools.cache
def usable_hbm(target: TpuTarget) -> int:
    """HBM bytes per chip the compiler lets a program use (a little under the chip's), read
    off its refusal of a program twice that size."""
    mesh = target.mesh(1)
    n = target.chip.hbm_bytes // 1024
    try:
        compile_for(mesh, lambda x: x * 2, abstract(mesh, (n, 1024), jnp.bfloat16))
    except Exception as e:
        m = re.search(r"available HBM \(([\d.]+)G\)", str(e))
        if m:
            return int(float(m.group(1)) * GiB)
    return int(target.chip.hbm_bytes * 0.97)


def plan(
    model_cfg: ModelConfig,
    cfg: EngineConfig,
    target: TpuTarget,
    *,
    dtype=None,
    decode_context: int | None = None,
    progress=print,
) -> Plan:
    server = AbstractServer.build(model_cfg, cfg, target, dtype=dtype)
    hbm = usable_hbm(target)
    weights = server.weights_bytes()
    split = server.cache_bytes_by_kind()
    kv, state = split["kv"], split["state"]
    progress(f"weights {weights / GiB:.2f} GiB, cache {(kv + state) / GiB:.2f} GiB per chip")
    if weights + kv + state > hbm:  # no program compiles (the compiler refuses it): say so now
        raise DoesNotFit(_over(weights, kv + state, None, hbm, target))
    progress("compiling")
    temp, temp_program = _temporaries(server, progress)
    need = weights + kv + state + temp
    if need > hbm:
        raise DoesNotFit(_over(weights, kv + state, temp, hbm, target))
    free = hbm - need
    per_token = kv / cfg.max_total_tokens  # both page pools scale with max_total_tokens
    tokens = cfg.max_total_tokens + int(free // per_token) if per_token else cfg.max_total_tokens
    tokens -= tokens % cfg.page_size
    slots = cfg.num_state_slots
    slots_fit = slots + int(free // (state / slots)) if state else None
    tokens, confirmed = _confirm(model_cfg, cfg, target, dtype, tokens, temp_program, progress, need, hbm)
    context = decode_context or max(cfg.page_size, cfg.max_total_tokens // cfg.max_running_requests)
    steps = _step_costs(model_cfg, cfg, target, dtype, context, progress)
    dtype_bytes = jnp.dtype(server.model.dtype).itemsize
    return Plan(
        topology=target.topology,
        tp_size=cfg.tp_size,
        hbm_bytes=hbm,
        weights_bytes=weights,
        kv_pool_bytes=kv,
        state_bytes=state,
        temp_bytes=temp,
        temp_program=temp_program,
        max_total_tokens=cfg.max_total_tokens,
        max_total_tokens_that_fit=tokens,
        fit_confirmed=confirmed,
        state_slots=slots,
        state_slots_that_fit=slots_fit,
        steps=steps,
        l3_read_bytes_per_token=read_bytes_per_token(model_cfg, dtype_bytes, cfg.page_size),
    )


def _over(weights: int, cache: int, temp: int | None, hbm: int, target: TpuTarget) -> str:
    """The one line saying by how much a configuration does not fit (``temp`` None: its
    weights and cache alone do not, so nothing was compiled)."""
    need = weights + cache + (temp or 0)
    parts = f"weights {weights / GiB:.2f}, cache {cache / GiB:.2f}"
    parts += ", before temporaries" if temp is None else f", temporaries {temp / GiB:.2f}"
    return (
        f"does not fit: {need / GiB:.2f} GiB per chip needed ({parts}), {target.chip.name} has "
        f"{hbm / GiB:.2f} GiB: {(need - hbm) / GiB:.2f} GiB over"
    )


def _largest_programs(server: AbstractServer) -> set[str]:
    """The programs whose temporaries bound the rest: the largest decode and prefill bucket,
    per-token logits rows with top logprobs, and the largest page copies."""
    b = server.builder
    S = b.max_running
    decode = max(s for _, s, _, only in b.warmup_shapes() if only)
    T = b.buckets[-1]
    names = {f"decode step T={decode} S={decode} R={decode} top=20", f"prefill step T={T} S={S} R={T} top=20"}
    if server.transfer is not None:
        for kind in server.transfer.kinds():
            n = server.transfer.buckets(kind)[-1]
            names |= {f"read {kind} x{n}", f"write {kind} x{n}"}
    return names


def _temporaries(server: AbstractServer, progress) -> tuple[int, str]:
    want = _largest_programs(server)
    best, which = 0, ""
    for name, compiled in server.compile(lambda n: n in want):
        temp = compiled.memory_analysis().temp_size_in_bytes
        progress(f"  {name}: {temp / GiB:.3f} GiB of temporaries")
        if temp >= best:
            best, which = temp, name
    return best, which


def _confirm(
    model_cfg, cfg, target, dtype, tokens: int, program: str, progress, need: int, hbm: int
) -> tuple[int, bool]:
    """Compile ``program`` with a pool of ``tokens``. Where it does not fit (temporaries that
    grow with the pool: a pool-sized copy), the compiler's refusal says how much it needed;
    a line through that and the configured pool's ``need`` gives the next size to try.
    Returns the pool and whether a compile confirmed it."""
    points = [(cfg.max_total_tokens, need)]
    for _ in range(4):
        bigger = cfg.replace(max_total_tokens=tokens)
        server = AbstractServer.build(model_cfg, bigger, target, dtype=dtype)
        try:
            list(server.compile(lambda n: n == program))
            progress(f"  max_total_tokens={tokens}: {program} compiles")
            return tokens, True
        except RuntimeError as e:
            m = re.search(r"required for HLO temporaries \(([\d.]+)G\)", str(e.__cause__ or e))
            if "RESOURCE_EXHAUSTED" not in str(e.__cause__ or e) or not m:
                raise
            points.append((tokens, float(m.group(1)) * GiB))
            progress(f"  max_total_tokens={tokens}: {program} needs {points[-1][1] / GiB:.2f} GiB")
        (n0, b0), (n1, b1) = points[-2], points[-1]
        per_token = (b1 - b0) / (n1 - n0)
        tokens = int(n0 + 0.98 * (hbm - b0) / per_token) if per_token > 0 else int(tokens * 0.9)
        tokens = max(cfg.page_size, tokens // cfg.page_size * cfg.page_size)
    return tokens, False


def _step_costs(model_cfg, cfg, target, dtype, context: int, progress) -> tuple[StepCost, ...]:
    """Decode at each of ``DECODE_BATCHES`` (every sequence at ``context`` tokens) and one
    prefill chunk, costed from the compiled programs."""
    cost_cfg = cfg.replace(context_length=context)
    server = AbstractServer.build(model_cfg, cost_cfg, target, dtype=dtype)
    chip = target.chip
    shapes = [(f"decode x{b}", b, (b, b, b, True)) for b in DECODE_BATCHES]
    chunk = cfg.chunked_prefill_size
    shapes.append(
        (f"prefill {chunk}", chunk, (chunk, cfg.max_running_requests, cfg.max_running_requests, False))
    )
    out = []
    for name, tokens, shape in shapes:
        compiled = server.compile_step(shape)
        # HBM bytes as they lie in HBM (``hbm.py``): cost_analysis also counts VMEM copies.
        flops, hbm = step_cost(compiled).get("flops", 0.0), hbm_bytes(compiled)
        roof = max(flops / chip.bf16_flops_per_s, hbm / chip.hbm_bytes_per_s)
        out.append(StepCost(name, tokens, flops, hbm, roof))
        progress(f"  {name}: {flops / 1e9:.1f} GFLOP, {hbm / 2**20:.0f} MiB")
    return tuple(out)


def step_cost(compiled: jax.stages.Compiled) -> dict:
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list) else (cost or {})


def format_plan(p: Plan, model_cfg: ModelConfig, cfg: EngineConfig, target: TpuTarget) -> str:
    chip = target.chip
    g = lambda b: f"{b / GiB:8.2f} GiB"
    lines = [
        f"{model_cfg.architecture} ({model_cfg.num_layers} layers) on {p.topology} at tp {p.tp_size}: "
        f"{cfg.dtype}, page {cfg.page_size}, chunk {cfg.chunked_prefill_size}, "
        f"{cfg.max_running_requests} running",
        f"per chip ({chip.name}, {g(p.hbm_bytes).strip()} usable HBM)",
        f"  weights        {g(p.weights_bytes)}",
        f"  KV pool        {g(p.kv_pool_bytes)}   ({p.max_total_tokens:,} tokens)",
    ]
    if p.state_bytes:
        lines.append(f"  Mamba state    {g(p.state_bytes)}   ({p.state_slots} slots)")
    lines += [
        f"  temporaries    {g(p.temp_bytes)}   (largest: {p.temp_program})",
        f"  free           {g(p.free_bytes)}",
        f"fits: --max_total_tokens up to {p.max_total_tokens_that_fit:,}"
        + ("" if p.fit_confirmed else " (NOT confirmed: 4 compiles near it ran out of HBM)")
        + (
            f"; or --mamba_cache_slots up to {p.state_slots_that_fit} at {p.max_total_tokens:,} tokens"
            if p.state_slots_that_fit
            else ""
        ),
        f"per step ({chip.bf16_flops_per_s / 1e12:.0f} TFLOP/s, "
        f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s per chip)",
        f"  {'step':<14}{'GFLOP':>10}{'HBM MiB':>10}{'roofline ms':>13}{'tokens/s':>11}",
    ]
    for s in p.steps:
        lines.append(
            f"  {s.name:<14}{s.flops / 1e9:>10.1f}{s.hbm_bytes / 2**20:>10.0f}"
            f"{s.roofline_s * 1e3:>13.3f}{s.tokens_per_s:>11,.0f}"
        )
    prefill = p.steps[-1]
    l3 = p.l3_read_bytes_per_token * prefill.tokens_per_s
    lines.append(
        f"L3: serving prompts at the prefill rate ({prefill.tokens_per_s:,.0f} tokens/s) from L3 reads "
        f"{p.l3_read_bytes_per_token / 1024:.0f} KiB/token = {l3 / 1e9:.2f} GB/s"
    )
    return "\n".join(lines)
