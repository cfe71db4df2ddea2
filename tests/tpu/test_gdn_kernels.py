"""Compile-only: the Gated DeltaNet kernels (``gdn_ragged`` for prefill and mixed batches,
``gdn_decode`` for decode-only ones) compile for v5e and v6e at Qwen3-Next / Qwen3.5 shapes
per chip, with the head block each chip's VMEM budget allows, and report their cost to XLA.

Shapes are per tensor-parallel shard: head dims 128 (key and value), value heads / tp (q and
k come repeated to the value heads), bf16 and f32 inputs, the f32 state pool. Qwen3-Next-80B
has 32 value heads (16 key heads), Qwen3.5's larger models 64, its smaller ones 16.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from hicache_jax.models.kernels import sharded, vmem
from hicache_jax.models.kernels.gated_delta_rule import decode_kernel, kernel
from hicache_jax.models.sharding import AXIS
from hicache_jax.tpu.target import abstract, compile_for, target, tracing_for

DK = DV = 128
MAIN = ("v5e:2x2", "v6e:2x4")


def gdn_args(mesh, T: int, S: int, H: int, dtype, num_slots: int) -> tuple:
    """Abstract ``(q, k, v, g, beta, cu_seqlens, num_seqs, states, slots, has_initial_state)``
    on ``mesh``, heads split over its axis when it has more than one device."""
    tp = mesh.shape[AXIS]
    spec = lambda *s: P(*s) if tp > 1 else None
    f = lambda shape, dt=jnp.float32, s=None: abstract(mesh, shape, dt, s)
    i32 = jnp.int32
    return (
        f((T, H, DK), dtype, spec(None, AXIS)),
        f((T, H, DK), dtype, spec(None, AXIS)),
        f((T, H, DV), dtype, spec(None, AXIS)),
        f((T, H), s=spec(None, AXIS)),
        f((T, H), s=spec(None, AXIS)),
        f((S + 1,), i32),
        f((), i32),
        f((num_slots, H, DK, DV), s=spec(None, AXIS)),
        f((S,), i32),
        f((S,), jnp.bool_),
    )


def compile_gdn(topology: str, fn, T: int, S: int, H: int, dtype, num_slots: int, tp: int = 1):
    """Compile one step of ``fn`` (the state pool donated, as the engine does) on ``tp`` chips;
    ``H``: value heads of the whole model."""
    mesh = target(topology).mesh(tp)
    return compile_for(mesh, fn, *gdn_args(mesh, T, S, H, dtype, num_slots), donate_argnums=(7,))


def assert_costed(compiled, estimate) -> None:
    """XLA's cost analysis of the step counts the kernel's CostEstimate (plus the wrapper's
    few elementwise ops)."""
    cost = compiled.cost_analysis()
    assert estimate.flops <= cost["flops"] <= 1.01 * estimate.flops
    assert estimate.transcendentals <= cost["transcendentals"] <= 1.01 * estimate.transcendentals
    assert cost["bytes accessed"] >= estimate.bytes_accessed


# (topology, S sequences, heads per chip, dtype, slots): 8 heads is Qwen3-Next at tp 4,
# 16 Qwen3.5 (64 value heads) at tp 4, 4 at tp 8.
DECODE = [
    ("v5e:2x2", 8, 8, jnp.bfloat16, 64),
    ("v6e:2x4", 64, 16, jnp.float32, 128),
    ("v6e:2x4", 24, 4, jnp.bfloat16, 64),
]


@pytest.mark.parametrize("topology,S,H,dtype,slots", DECODE)
def test_decode_compiles(topology, S, H, dtype, slots):
    compiled = compile_gdn(topology, decode_kernel.gdn_decode, S, S, H, dtype, slots)
    with tracing_for(target(topology).mesh(1)):
        hb = kernel.pick_head_block(H, DK, DV, dtype)
    assert hb == min(H, 8)
    assert_costed(compiled, kernel.decode_cost(S, H, DK, DV, dtype))


# (topology, T rows, S sequences, heads per chip, dtype, chunk): a prefill chunk over several
# sequences (T not a multiple of the chunk in one case). A compile takes 1-2 s (prefill head
# blocks of 2; see kernel.MAX_HEAD_BLOCK).
RAGGED = [
    ("v5e:2x2", 512, 4, 8, jnp.bfloat16, 64),
    ("v6e:2x4", 300, 8, 8, jnp.float32, 64),
    ("v6e:2x4", 256, 4, 16, jnp.bfloat16, 128),
]


@pytest.mark.parametrize("topology,T,S,H,dtype,chunk", RAGGED)
def test_ragged_compiles(topology, T, S, H, dtype, chunk):
    step = lambda *a: kernel.gdn_ragged(*a, chunk=chunk)
    compiled = compile_gdn(topology, step, T, S, H, dtype, 64)
    with tracing_for(target(topology).mesh(1)):
        hb = kernel.pick_head_block(H, DK, DV, dtype, chunk)
    Tp = -(-T // chunk) * chunk
    assert_costed(compiled, kernel.ragged_cost(Tp, S, 64, H, DK, DV, hb, chunk, dtype))


@pytest.mark.parametrize("topology,decode", [("v6e:2x4", True), ("v5e:2x2", False)])
def test_tensor_parallel_step_compiles(topology, decode):
    """Qwen3-Next-80B's 32 value heads over 4 chips through ``sharded.gdn``."""
    fn = sharded.gdn(decode_kernel.gdn_decode if decode else kernel.gdn_ragged, target(topology).mesh(4))
    T, S = (32, 32) if decode else (512, 8)
    compile_gdn(topology, fn, T, S, 32, jnp.bfloat16, 128, tp=4)


@pytest.mark.parametrize("topology,at_bound", [(MAIN[0], "ragged"), (MAIN[1], "decode")])
def test_chosen_blocks_fit_the_budget(topology, at_bound, monkeypatch):
    """The chosen head blocks' VMEM bounds fit the tile budget, and the bounds are real: the
    kernel compiles with its scoped VMEM limit cut to its bound (f32 inputs, the largest)."""
    mesh = target(topology).mesh(1)
    with tracing_for(mesh):
        budget = vmem.tile_budget()
        hb, hb_dec = kernel.check_shapes(8, DK, DV, jnp.float32, 128)
    ragged = kernel.ragged_vmem_bytes(hb, 128, DK, DV, jnp.float32)
    decode = kernel.decode_vmem_bytes(hb_dec, DK, DV, jnp.float32)
    assert ragged <= budget and decode <= budget
    # __wrapped__: trace afresh, the jit caches would replay a trace made under the full limit.
    if at_bound == "ragged":
        monkeypatch.setattr(vmem, "budget", lambda: ragged)
        step = lambda *a: kernel.gdn_ragged.__wrapped__(*a, chunk=128, head_block=hb)
        compile_for(mesh, step, *gdn_args(mesh, 256, 4, 8, jnp.float32, 64))
    else:
        monkeypatch.setattr(vmem, "budget", lambda: decode)
        step = lambda *a: decode_kernel.gdn_decode.__wrapped__(*a, head_block=hb_dec)
        compile_for(mesh, step, *gdn_args(mesh, 16, 16, 8, jnp.float32, 64))
