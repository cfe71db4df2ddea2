"""The serving programs of one engine configuration, built from shapes for a TPU slice.

The engine's own parts are used (``build.make_runner``, ``make_builder``, the warm-up's
program list, ``PageTransfer``), with two changes: the weights are ``ShapeDtypeStruct``s
from ``nnx.eval_shape`` and the runner allocates no cache (``ModelRunner(abstract_on=)``).
So no array is materialised, yet every program is the one warm-up compiles on a chip: the
prefill, decode and logits-row buckets of the step, and the L2 page copies.

    servable = AbstractServer.build(model_cfg, engine_cfg, target("v6e:2x4"))
    for name, compiled in servable.compile():     # jax.stages.Compiled, for that slice
        compiled.memory_analysis(), compiled.cost_analysis()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hicache_jax.config import EngineConfig
from hicache_jax.engine import warmup
from hicache_jax.engine.build import (
    attach_drafter,
    context_length,
    layerwise_pages,
    make_builder,
    make_device_pools,
    make_runner,
)
from hicache_jax.models import kv_quant
from hicache_jax.models.cache import RecurrentState
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.loader import resolve_dtype
from hicache_jax.models.sharding import abstract_weights, make_mesh
from hicache_jax.runtime.batch_builder import BatchBuilder
from hicache_jax.runtime.runner import ModelRunner
from hicache_jax.runtime.transfer import PageTransfer
from hicache_jax.speculative.drafters import MtpDrafter, make_drafter
from hicache_jax.tpu.target import TpuTarget, tracing_for

Select = Callable[[str], bool] | None  # which programs, by name (None: all)


@dataclasses.dataclass
class AbstractServer:
    cfg: EngineConfig
    target: TpuTarget
    mesh: Mesh  # the tp_size chips the programs run on
    model: CausalLM  # weights are ShapeDtypeStructs
    runner: ModelRunner
    builder: BatchBuilder
    transfer: PageTransfer | None  # with the host tier (L2) on

    @classmethod
    def build(
        cls, model_cfg: ModelConfig, cfg: EngineConfig, target: TpuTarget, dtype=None
    ) -> AbstractServer:
        """``dtype``: the weights' (default: ``cfg.dtype``, float32 for ``auto``)."""
        mesh = make_mesh(cfg.tp_size, target.devices)
        kernels = KernelConfig(
            attention=cfg.attention_backend or "pallas",
            ssd=cfg.ssd_backend or "pallas",
            mesh=mesh if cfg.tp_size > 1 else None,  # as build.load_model_and_tokenizer does
            moe="grouped",  # TPU's (the default here would be CPU's)
        )
        kernels.check_platform("tpu")
        dtype = dtype or resolve_dtype("float32" if cfg.dtype == "auto" else cfg.dtype)
        make = lambda: CausalLM(model_cfg, dtype=dtype, rngs=nnx.Rngs(0), kernels=kernels)
        with tracing_for(mesh):
            model = nnx.eval_shape(make)
        abstract_weights(model, mesh)
        # The pages in --kv_cache_dtype, refused as the engine refuses it for this chip; int8's
        # calibrated scales are numbers in the programs, not shapes: unit scales here.
        model.kv_dtype = kv_quant.resolve(cfg.kv_cache_dtype, dtype)
        kernels.check_model(model_cfg, dtype, kv_dtype=model.kv_dtype, chip=target.chip.name)
        # As the engine: its refusals, and for NEXTN the MTP block drafting in every step, for
        # EAGLE3 the draft (its config.json read, its weights shapes), its KV one more cache
        # layer (``Engine.__init__``).
        if isinstance(make_drafter(cfg, model_cfg), MtpDrafter):
            with tracing_for(mesh):
                attach_drafter(cfg, model, kernels, shapes_on=mesh)
            model_cfg = model.cfg
        pools = make_device_pools(cfg, model_cfg)
        runner = make_runner(cfg, model, pools, abstract_on=mesh)
        builder = make_builder(cfg, model_cfg, context_length(cfg, model_cfg))
        transfer = None
        if cfg.enable_hierarchical_cache:
            transfer = PageTransfer(runner, step_pages=layerwise_pages(cfg, "tpu"))
        return cls(cfg, target, mesh, model, runner, builder, transfer)

    def lowered(self, select: Select = None) -> Iterator[tuple[str, jax.stages.Lowered]]:
        """Every program serving runs (warm-up's list), or those whose name ``select``
        accepts, lowered for the slice."""
        for name, lower in warmup.lowerings(self.runner, self.builder, self.transfer):
            if select is None or select(name):
                with tracing_for(self.mesh):
                    yield name, lower()

    def compile(self, select: Select = None) -> Iterator[tuple[str, jax.stages.Compiled]]:
        for name, lowered in self.lowered(select):
            yield name, _compile(name, lowered)

    def weights_bytes(self) -> int:
        """Weight bytes on one chip (its shards; replicated weights whole)."""
        return _per_chip(self.runner.params)

    def embedding_bytes(self) -> int:
        """Bytes of the input embedding table on one chip."""
        return _per_chip(self.runner.params["embed"])

    def kernel_pool_shapes(self) -> set[tuple[int, ...]]:
        """Shapes on one chip of the cache arrays the Pallas kernels read by DMA: KV pages and
        SSM state (not the conv state, a few rows per slot that XLA's own ops gather)."""
        leaves = [e.ssm if isinstance(e, RecurrentState) else e for e in self.runner.cache]
        leaves = jax.tree_util.tree_leaves(leaves)
        return {tuple(x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape) for x in leaves}

    def cache_bytes(self) -> int:
        """Device cache bytes on one chip: KV pages and recurrent state slots."""
        return sum(self.cache_bytes_by_kind().values())

    def cache_bytes_by_kind(self) -> dict[str, int]:
        """``{"kv": attention page bytes, "state": recurrent state bytes}`` on one chip."""
        out = {"kv": 0, "state": 0}
        for entry in self.runner.cache:
            out["state" if isinstance(entry, RecurrentState) else "kv"] += _per_chip(entry)
        return out

    def compile_step(self, shape: tuple[int, int, int, bool], top_logprobs: int = 0) -> jax.stages.Compiled:
        """One step program of the given (T, S, R, decode_only), whether or not the engine's
        buckets include it (the planner's decode batches)."""
        with tracing_for(self.mesh):
            lowered = warmup.lower_step(self.runner, self.builder, shape, top_logprobs)
        return _compile(f"step {shape}", lowered)


def _per_chip(tree) -> int:
    def one(x) -> int:
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        return int(np.prod(shape)) * np.dtype(x.dtype).itemsize

    return sum(one(x) for x in jax.tree_util.tree_leaves(tree))


def _compile(name: str, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    try:
        return lowered.compile()
    except Exception as e:
        raise RuntimeError(f"compiling {name} for TPU failed: {str(e).splitlines()[0]}") from e
