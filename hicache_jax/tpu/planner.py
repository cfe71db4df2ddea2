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

Layers are unrolled in every program, so compile time and the compiler's memory grow with
depth and with the number of programs (seven here: two for temporaries, one to confirm the
pool, four costed steps). At DeepSeek V4 Flash's 43 layers a prefill program alone takes
minutes, and the whole plan more than half an hour on a 2-core host. ``depths`` plans from
compiles at a few depths instead: the model cut to its first ``d`` layers (``first_layers``),
at depths a whole number of periods of the layer pattern apart (``pattern_depths``: a
layer's kind and the per-layer lists it is in, such as ``sparse_layers``), and every
compiled figure (each program's temporaries, each step's flops and HBM bytes) extrapolated
linearly in layers from the first two to the model's depth. A third depth checks the line:
the plan reports the largest relative distance of a figure there from its prediction.
Weights and cache bytes are never extrapolated: they come exactly from the shapes of the
full-depth model. ``"auto"`` picks depths only where the pattern runs to the last layer;
with depths given by hand, layers past them that break the pattern are not seen by the
line or its check. Temporaries are the compiler's scheduling, not a per-layer sum, and fit
the line least well. The pool is then confirmed by extrapolating the largest program's
temporaries at that pool from the same depths, not by a full-depth compile; where they
grow with the pool this finds a smaller pool than the full-depth search (an 8-layer test
model: 5.4M tokens against 8.1M), never a larger one there. ``memo`` keeps
each compiled group of figures in a file, so a stopped run resumes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
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
    num_layers: int = 0
    # Compiled at these depths (fit, fit, check) and extrapolated; None: at full depth.
    depths: tuple[int, ...] | None = None
    # Largest |compiled - predicted| / compiled at the check depth, and which figure.
    check_error: float | None = None
    check_worst: str = ""

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
    depths: tuple[int, ...] | str | None = None,
    memo: str | None = None,
) -> Plan:
    """``depths``: None compiles at full depth; ``(d1, d2, d3)`` compiles at those depths,
    extrapolates from ``d1`` and ``d2`` and checks at ``d3``; ``"auto"`` picks them with
    ``pattern_depths`` (full depth when the model is too shallow to gain from it).
    ``memo``: a JSON file keeping each compiled group of figures (``Memo``)."""
    keep = Memo(memo, cfg, target, dtype) if memo else lambda what, m, fn: fn()
    server = AbstractServer.build(model_cfg, cfg, target, dtype=dtype)
    hbm = usable_hbm(target)
    weights = server.weights_bytes()
    split = server.cache_bytes_by_kind()
    kv, state = split["kv"], split["state"]
    progress(f"weights {weights / GiB:.2f} GiB, cache {(kv + state) / GiB:.2f} GiB per chip")
    if weights + kv + state > hbm:  # no program compiles (the compiler refuses it): say so now
        raise DoesNotFit(_over(weights, kv + state, None, hbm, target))
    if depths == "auto":
        depths = pattern_depths(model_cfg)
    line = Line(model_cfg, tuple(depths), progress) if depths else None
    progress("compiling" + (f" at {', '.join(map(str, depths))} layers" if depths else ""))
    measure = lambda m: keep("temporaries", m, lambda: _temporaries(m, cfg, target, dtype, progress))
    temps = line.figures(measure) if line else measure(model_cfg)
    temp_program = max(temps, key=temps.get)
    temp = int(temps[temp_program])
    need = weights + kv + state + temp
    if need > hbm:
        raise DoesNotFit(_over(weights, kv + state, temp, hbm, target))
    free = hbm - need
    per_token = kv / cfg.max_total_tokens  # both page pools scale with max_total_tokens
    tokens = cfg.max_total_tokens + int(free // per_token) if per_token else cfg.max_total_tokens
    tokens -= tokens % cfg.page_size
    slots = cfg.num_state_slots
    slots_fit = slots + int(free // (state / slots)) if state else None
    if line:
        tokens, confirmed = _confirm_on_line(
            line, keep, model_cfg, cfg, target, dtype, tokens, temp_program, need, hbm
        )
    else:
        tokens, confirmed = _confirm(model_cfg, cfg, target, dtype, tokens, temp_program, progress, need, hbm)
    context = decode_context or max(cfg.page_size, cfg.max_total_tokens // cfg.max_running_requests)
    cost = lambda m: keep(
        f"steps at {context}", m, lambda: _step_figures(m, cfg, target, dtype, context, progress)
    )
    steps = _step_costs(line.figures(cost) if line else cost(model_cfg), cfg, target)
    dtype_bytes = jnp.dtype(server.model.dtype).itemsize
    kv_bytes = jnp.dtype(server.model.kv_dtype).itemsize  # --kv_cache_dtype's
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
        l3_read_bytes_per_token=read_bytes_per_token(model_cfg, dtype_bytes, cfg.page_size, kv_bytes),
        num_layers=model_cfg.num_layers,
        depths=line.depths if line else None,
        check_error=line.worst[0] if line else None,
        check_worst=line.worst[1] if line else "",
    )


def first_layers(model_cfg: ModelConfig, depth: int) -> ModelConfig:
    """The model cut to its first ``depth`` layers: ``layer_kinds`` and every per-layer
    index list (a tuple field named ``*_layers``, in the config or a sub-config, such as
    ``sparse_layers`` or DeepSeek V4's ``hash_layers``) cut to match."""
    if not 1 <= depth <= model_cfg.num_layers:
        raise ValueError(f"depth {depth}: the model has layers 1..{model_cfg.num_layers}")

    def cut(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name.endswith("_layers") and isinstance(v, tuple):
                changes[f.name] = tuple(i for i in v if i < depth)
            elif dataclasses.is_dataclass(v):
                changes[f.name] = cut(v)
        return dataclasses.replace(obj, **changes)

    return dataclasses.replace(cut(model_cfg), layer_kinds=model_cfg.layer_kinds[:depth])


def layer_signatures(model_cfg: ModelConfig) -> list[tuple]:
    """Per layer: its kind and the names of the per-layer index lists it is in."""
    lists: list[tuple[str, tuple[int, ...]]] = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name.endswith("_layers") and isinstance(v, tuple):
                lists.append((prefix + f.name, v))
            elif dataclasses.is_dataclass(v):
                walk(v, f"{prefix}{f.name}.")

    walk(model_cfg, "")
    return [
        (kind, *(name for name, idx in lists if i in idx)) for i, kind in enumerate(model_cfg.layer_kinds)
    ]


def pattern_depths(model_cfg: ModelConfig) -> tuple[int, int, int] | None:
    """Depths ``s``, ``s + p``, ``s + 2p`` (``s >= 1``) such that the layers from ``s`` to
    the last repeat with period ``p`` (their signatures, ``layer_signatures``): each step of
    the line adds one whole period, and so does every layer past it up to the model's depth
    (a last partial period excepted). The cheapest such (least ``s + 2p``, then least
    ``p``); None where compiling the three depths costs as many layers as the model (compile
    at full depth, or pass depths)."""
    sig = layer_signatures(model_cfg)
    n = len(sig)
    found = [
        (s + 2 * p, p, s)
        for p in range(1, n // 2 + 1)
        for s in range(1, n - 2 * p)
        if all(sig[i] == sig[i + p] for i in range(s, n - p))
    ]
    if not found:
        return None
    _, p, s = min(found)
    return (s, s + p, s + 2 * p) if 3 * s + 3 * p < n else None


class Memo:
    """Compiled figures kept in a JSON file, keyed by what decides them (the figures' name,
    the model config at its depth, the engine config, the slice, the dtype, the package's
    and the models' source): a run stopped part way, or one that changes nothing they
    depend on, compiles only what is missing."""

    def __init__(self, path: str, cfg: EngineConfig, target: TpuTarget, dtype):
        self.path, self.fixed = path, (cfg, target.topology, str(dtype), _source_digest())
        self.data = {}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)

    def __call__(self, what: str, model_cfg: ModelConfig, fn) -> dict[str, float]:
        key = hashlib.sha256(repr((what, model_cfg, *self.fixed)).encode()).hexdigest()
        if key not in self.data:
            self.data[key] = fn()
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.data, f)
            os.replace(self.path + ".tmp", self.path)
        return self.data[key]


def _source_digest() -> str:
    """sha256 of every ``.py`` file of ``hicache_jax`` and ``hicache_jax.models``."""
    import hicache_jax
    import hicache_jax.models

    h = hashlib.sha256()
    for root in (*hicache_jax.__path__, *hicache_jax.models.__path__):
        for dirpath, _, names in sorted(os.walk(root)):
            for name in sorted(n for n in names if n.endswith(".py")):
                with open(os.path.join(dirpath, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


class Line:
    """Figures compiled at ``depths`` (fit, fit, check) and extrapolated linearly in layers
    to the model's depth; ``worst`` is the largest relative miss at the check depth."""

    def __init__(self, model_cfg: ModelConfig, depths: tuple[int, ...], progress):
        if len(depths) != 3 or not 1 <= depths[0] < depths[1] < depths[2] <= model_cfg.num_layers:
            n = model_cfg.num_layers
            raise ValueError(f"depths {depths}: need three increasing depths (fit, fit, check) in 1..{n}")
        self.model_cfg, self.depths, self.progress = model_cfg, depths, progress
        self.worst: tuple[float, str] = (0.0, "")

    def predict(self, at: int, d1: int, y1: float, d2: int, y2: float) -> float:
        return y1 + (y2 - y1) * (at - d1) / (d2 - d1)

    def figures(self, measure, check: bool = True) -> dict[str, float]:
        """``measure(model_cfg) -> {name: figure}`` at each depth, extrapolated."""
        d1, d2, d3 = self.depths
        at = [measure(first_layers(self.model_cfg, d)) for d in (self.depths if check else (d1, d2))]
        out = {}
        for name in at[0]:
            y1, y2 = at[0][name], at[1][name]
            if check:
                want, got = at[2][name], self.predict(d3, d1, y1, d2, y2)
                miss = abs(got - want) / abs(want) if want else float(got != 0)
                self.progress(f"  {name}: {want:.4g} at {d3} layers, the line says {got:.4g} ({miss:.1%})")
                self.worst = max(self.worst, (miss, name))
            out[name] = max(0.0, self.predict(self.model_cfg.num_layers, d1, y1, d2, y2))
        return out


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
    decode = max(shape.S for shape in b.warmup_shapes() if shape.decode_only)
    T = b.buckets[-1]
    names = {f"decode step T={decode} S={decode} R={decode} top=20", f"prefill step T={T} S={S} R={T} top=20"}
    if server.transfer is not None:
        for kind in server.transfer.kinds():
            n = server.transfer.buckets(kind)[-1]
            names |= {f"read {kind} x{n}", f"write {kind} x{n}"}
    return names


def _temporaries(model_cfg, cfg, target, dtype, progress) -> dict[str, float]:
    """Temporaries of the programs that bound the rest, by name."""
    server = AbstractServer.build(model_cfg, cfg, target, dtype=dtype)
    want = _largest_programs(server)
    out = {}
    for name, compiled in server.compile(lambda n: n in want):
        out[name] = compiled.memory_analysis().temp_size_in_bytes
        progress(f"  {name} ({model_cfg.num_layers} layers): {out[name] / GiB:.3f} GiB of temporaries")
    return out


def _confirm_on_line(
    line: Line, keep, model_cfg, cfg, target, dtype, tokens: int, program: str, need: int, hbm: int
) -> tuple[int, bool]:
    """The extrapolated plan's confirmation: ``program``'s temporaries at a pool of
    ``tokens``, extrapolated from the fit depths (a depth whose compile runs out of HBM
    counts the temporaries its refusal names), with the full model's exact weights and cache
    at that pool, must fit HBM. Where they do not, a line through that and the configured
    pool's ``need`` gives the next size to try, as ``_confirm`` does at full depth."""

    def temp(m, bigger):
        server = AbstractServer.build(m, bigger, target, dtype=dtype)
        try:
            ((_, compiled),) = server.compile(lambda n: n == program)
        except RuntimeError as e:
            found = re.search(r"required for HLO temporaries \(([\d.]+)G\)", str(e.__cause__ or e))
            if not found:
                raise
            return {program: float(found.group(1)) * GiB}
        return {program: compiled.memory_analysis().temp_size_in_bytes}

    points = [(cfg.max_total_tokens, need)]
    for _ in range(4):
        bigger = cfg.replace(max_total_tokens=tokens)
        what = f"{program} at {tokens} tokens"
        kept = lambda m, what=what, bigger=bigger: keep(what, m, lambda: temp(m, bigger))
        server = AbstractServer.build(model_cfg, bigger, target, dtype=dtype)
        need = server.weights_bytes() + server.cache_bytes() + line.figures(kept, check=False)[program]
        if need <= hbm:
            line.progress(f"  max_total_tokens={tokens}: {program} fits on the line ({need / GiB:.2f} GiB)")
            return tokens, True
        line.progress(f"  max_total_tokens={tokens}: {program} needs {need / GiB:.2f} GiB on the line")
        points.append((tokens, need))
        (n0, b0), (n1, b1) = points[-2], points[-1]
        per_token = (b1 - b0) / (n1 - n0)
        tokens = int(n0 + 0.98 * (hbm - b0) / per_token) if per_token > 0 else int(tokens * 0.9)
        tokens = max(cfg.page_size, tokens // cfg.page_size * cfg.page_size)
    return tokens, False


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


def _step_shapes(cfg) -> list[tuple[str, int, tuple]]:
    """Decode at each of ``DECODE_BATCHES`` and one prefill chunk: (name, tokens, shape)."""
    shapes = [(f"decode x{b}", b, (b, b, b, True)) for b in DECODE_BATCHES]
    chunk, running = cfg.chunked_prefill_size, cfg.max_running_requests
    return shapes + [(f"prefill {chunk}", chunk, (chunk, running, running, False))]


def _step_figures(model_cfg, cfg, target, dtype, context: int, progress) -> dict[str, float]:
    """``{"<step> flops": .., "<step> hbm": ..}`` of each step, every sequence at ``context``
    tokens, from the compiled programs."""
    server = AbstractServer.build(model_cfg, cfg.replace(context_length=context), target, dtype=dtype)
    out = {}
    for name, _, shape in _step_shapes(cfg):
        compiled = server.compile_step(shape)
        # HBM bytes as they lie in HBM (``hbm.py``): cost_analysis also counts VMEM copies.
        out[f"{name} flops"] = step_cost(compiled).get("flops", 0.0)
        out[f"{name} hbm"] = hbm_bytes(compiled)
        progress(
            f"  {name} ({model_cfg.num_layers} layers): {out[f'{name} flops'] / 1e9:.1f} GFLOP, "
            f"{out[f'{name} hbm'] / 2**20:.0f} MiB"
        )
    return out


def _step_costs(figures: dict[str, float], cfg, target: TpuTarget) -> tuple[StepCost, ...]:
    chip = target.chip
    out = []
    for name, tokens, _ in _step_shapes(cfg):
        flops, hbm = figures[f"{name} flops"], figures[f"{name} hbm"]
        roof = max(flops / chip.bf16_flops_per_s, hbm / chip.hbm_bytes_per_s)
        out.append(StepCost(name, tokens, flops, hbm, roof))
    return tuple(out)


def step_cost(compiled: jax.stages.Compiled) -> dict:
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list) else (cost or {})


def _extrapolation_lines(p: Plan) -> list[str]:
    if not p.depths:
        return []
    d1, d2, d3 = p.depths
    return [
        f"EXTRAPOLATED: temporaries, flops and HBM bytes compiled at the first {d1} and {d2} layers and "
        f"extrapolated linearly to {p.num_layers} (weights and cache exact, from shapes); at {d3} layers "
        f"the line misses by at most {p.check_error:.1%} ({p.check_worst})"
    ]


def format_plan(p: Plan, model_cfg: ModelConfig, cfg: EngineConfig, target: TpuTarget) -> str:
    chip = target.chip
    g = lambda b: f"{b / GiB:8.2f} GiB"
    lines = [
        f"{model_cfg.architecture} ({model_cfg.num_layers} layers) on {p.topology} at tp {p.tp_size}: "
        f"{cfg.dtype}, KV {cfg.kv_cache_dtype}, page {cfg.page_size}, chunk {cfg.chunked_prefill_size}, "
        f"{cfg.max_running_requests} running",
        *_extrapolation_lines(p),
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
        + (
            (" (confirmed on the line)" if p.depths else "")
            if p.fit_confirmed
            else " (NOT confirmed: "
            + ("over HBM on the line)" if p.depths else "4 compiles near it ran out of HBM)")
        )
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
