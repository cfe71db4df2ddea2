"""Compile-only: the Mamba2 SSD kernels (``ssd_ragged`` for prefill and mixed batches,
``ssd_decode`` for decode-only ones) compile for v5e, v6e and v5p at the shapes the engine
produces, with the head block each chip's VMEM budget allows, and report their cost to XLA.

Shapes are per tensor-parallel shard (heads / tp; groups repeated to one per shard when
fewer than tp): bf16 and f32 inputs, the f32 state pool. A compile takes 0.3-3 s, so the
matrix rotates model shards and dtypes through the batch sizes instead of a full product.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from hicache_jax.models.kernels import sharded, vmem
from hicache_jax.models.kernels.mamba2_ssd import decode_kernel, kernel
from hicache_jax.models.sharding import AXIS
from hicache_jax.tpu.target import abstract, compile_for, target, tracing_for

# (num_heads, num_groups, head_dim, state_size) of the supported families' Mamba2 layers.
MODELS = [
    (128, 1, 64, 128),  # Bamba-9B
    (128, 8, 64, 128),  # 8 groups
    (64, 2, 128, 64),
    (32, 1, 256, 128),
    (80, 1, 64, 128),  # 10 heads at tp 8: only blocks of 2 or all 10 span whole lane tiles
    (24, 8, 32, 64),  # 3 heads at tp 8: 96 lanes, one block of all heads
    (8, 1, 32, 256),  # 1 head at tp 8
]


def shard(model: tuple[int, int, int, int], tp: int) -> tuple[int, int, int, int]:
    """One shard's (H, G, P, N), as ``sharded.ssd`` hands them to the kernel."""
    H, G, P_, N = model
    return H // tp, max(G, tp) // tp, P_, N


SHARDS = [shard(m, tp) for tp in (1, 4, 8) for m in MODELS if m[0] % tp == 0]
DTYPES = (jnp.bfloat16, jnp.float32)
DECODE_SEQS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_ROWS = (16, 64, 256, 544, 1024, 2048)  # with 32 sequences
SLOTS = (128, 256)


def rotate(sizes: tuple[int, ...], offset: int) -> list[tuple]:
    """Each size with a different shard, dtype and pool size (shifted by ``offset``)."""
    shards = itertools.islice(itertools.cycle(SHARDS), offset * 5, None)
    return [
        (n, *next(shards), DTYPES[(i + offset) % 2], SLOTS[(i + offset) % 2]) for i, n in enumerate(sizes)
    ]


def ssd_args(mesh, T: int, S: int, H: int, G: int, P_: int, N: int, dtype, num_slots: int) -> tuple:
    """Abstract ``(x, dt, A, B, C, D, cu_seqlens, num_seqs, states, slots, has_initial_state)``
    on ``mesh``, heads split over its axis when it has more than one device."""
    tp = mesh.shape[AXIS]
    spec = lambda *s: P(*s) if tp > 1 else None
    f = lambda shape, dt=jnp.float32, s=None: abstract(mesh, shape, dt, s)
    i32 = jnp.int32
    return (
        f((T, H, P_), dtype, spec(None, AXIS)),
        f((T, H), s=spec(None, AXIS)),
        f((H,), s=spec(AXIS)),
        f((T, G, N), dtype, spec(None, AXIS) if G >= tp else None),
        f((T, G, N), dtype, spec(None, AXIS) if G >= tp else None),
        f((H,), s=spec(AXIS)),
        f((S + 1,), i32),
        f((), i32),
        f((num_slots, H, P_, N), s=spec(None, AXIS)),
        f((S,), i32),
        f((S,), jnp.bool_),
    )


def compile_ssd(topology: str, fn, T: int, S: int, shape: tuple, dtype, num_slots: int, tp: int = 1):
    """Compile one step of ``fn`` (the state pool donated, as the engine does) on ``tp`` chips;
    ``shape``: the model's (H, G, P, N)."""
    mesh = target(topology).mesh(tp)
    return compile_for(mesh, fn, *ssd_args(mesh, T, S, *shape, dtype, num_slots), donate_argnums=(8,))


def assert_costed(compiled, estimate) -> None:
    """XLA's cost analysis of the step counts the kernel's CostEstimate (plus the wrapper's
    few elementwise ops)."""
    cost = compiled.cost_analysis()
    assert estimate.flops <= cost["flops"] <= 1.01 * estimate.flops
    assert estimate.transcendentals <= cost["transcendentals"] <= 1.01 * estimate.transcendentals
    assert cost["bytes accessed"] >= estimate.bytes_accessed


MAIN = ("v5e:2x2", "v6e:2x4")


@pytest.mark.parametrize(
    "topology,S,H,G,P_,N,dtype,slots",
    [(t, *c) for i, t in enumerate(MAIN) for c in rotate(DECODE_SEQS, i)]
    + [("v5p:2x2x1", *c) for c in rotate((4, 64), 2)],
)
def test_decode_compiles(topology, S, H, G, P_, N, dtype, slots):
    compiled = compile_ssd(topology, decode_kernel.ssd_decode, S, S, (H, G, P_, N), dtype, slots)
    with tracing_for(target(topology).mesh(1)):
        hb = kernel.pick_head_block(H, G, P_, N, dtype)
    assert_costed(compiled, kernel.decode_cost(S, H, P_, N, G, hb, dtype))


@pytest.mark.parametrize(
    "topology,T,H,G,P_,N,dtype,slots",
    [(t, *c) for i, t in enumerate(MAIN) for c in rotate(PREFILL_ROWS, i + 3)]
    + [("v5p:2x2x1", *c) for c in rotate((64, 1024), 4)],
)
def test_ragged_compiles(topology, T, H, G, P_, N, dtype, slots):
    compiled = compile_ssd(topology, kernel.ssd_ragged, T, 32, (H, G, P_, N), dtype, slots)
    with tracing_for(target(topology).mesh(1)):
        hb = kernel.pick_head_block(H, G, P_, N, dtype, chunk=128)
    Tp = -(-T // 128) * 128
    assert_costed(compiled, kernel.ragged_cost(Tp, 32, slots, H, P_, N, G, hb, 128, dtype))


@pytest.mark.parametrize(
    "topology,decode,tp",
    [("v6e:2x4", True, 8), ("v5e:2x2", False, 4)],
)
def test_tensor_parallel_step_compiles(topology, decode, tp):
    """Bamba-9B's scan through ``sharded.ssd``: 128 heads over tp shards, its one B/C group
    repeated to one per shard."""
    fn = sharded.ssd(decode_kernel.ssd_decode if decode else kernel.ssd_ragged, target(topology).mesh(tp))
    T, S = (64, 64) if decode else (544, 32)
    compile_ssd(topology, fn, T, S, (128, 1, 64, 128), jnp.bfloat16, 256, tp=tp)


def test_head_block_follows_the_chip():
    """At head dim 256 with 256-row chunks, v5e and v6e (24 MiB of tiles) take 8 heads, v5p
    (12 MiB) fewer; at the engine's chunk of 128 all three take 8."""
    blocks = {}
    for topology in ("v5e:2x2", "v6e:2x4", "v5p:2x2x1"):
        with tracing_for(target(topology).mesh(1)):
            blocks[topology] = [kernel.pick_head_block(16, 1, 256, 128, jnp.bfloat16, q) for q in (128, 256)]
    assert blocks == {"v5e:2x2": [8, 8], "v6e:2x4": [8, 8], "v5p:2x2x1": [8, 2]}


# The most VMEM-hungry shards: head dim 256, f32 inputs, up to 8 groups in a block, state 256.
LARGEST = [
    (32, 1, 256, 128, jnp.float32, 256),
    (8, 8, 256, 128, jnp.float32, 128),
    (8, 1, 256, 256, jnp.bfloat16, 128),
]


def bounds(H: int, G: int, P_: int, N: int, dtype, chunk: int) -> tuple[int, int, int, int]:
    """(ragged head block, its VMEM bound, decode head block, its bound) for the traced chip."""
    hb, hb_dec = kernel.check_shapes(H, G, P_, N, dtype, chunk)
    gb = lambda hb: max(1, hb // (H // G))
    ragged = kernel.ragged_vmem_bytes(hb, gb(hb), chunk, P_, N, dtype)
    return hb, ragged, hb_dec, kernel.decode_vmem_bytes(hb_dec, gb(hb_dec), P_, N, dtype)


@pytest.mark.parametrize("topology,at_bound", [(MAIN[0], "ragged"), (MAIN[1], "decode")])
def test_chosen_blocks_fit_the_budget(topology, at_bound, monkeypatch):
    """At the largest shapes the chosen head blocks' VMEM bounds fit the tile budget, and the
    bounds are real: a kernel compiles with its scoped VMEM limit cut to its bound (one
    kernel per chip: a tight limit makes Mosaic slow, 3-5 s a compile; both chips have the
    same budget, so the same blocks)."""
    mesh = target(topology).mesh(1)
    with tracing_for(mesh):
        budget = vmem.tile_budget()
        found = {shape: bounds(*shape) for shape in LARGEST}
    for shape, (_, ragged, _, decode) in found.items():
        assert ragged <= budget and decode <= budget, shape
    # __wrapped__: trace afresh, the jit caches would replay a trace made under the full limit.
    if at_bound == "ragged":
        (H, G, P_, N, dtype, chunk), (hb, ragged, _, _) = LARGEST[1], found[LARGEST[1]]
        monkeypatch.setattr(vmem, "budget", lambda: ragged)
        step = lambda *a: kernel.ssd_ragged.__wrapped__(*a, chunk=chunk, head_block=hb)
        compile_for(mesh, step, *ssd_args(mesh, 2 * chunk, 16, H, G, P_, N, dtype, 128))
    else:
        (H, G, P_, N, dtype, _), (_, _, hb_dec, decode) = LARGEST[2], found[LARGEST[2]]
        monkeypatch.setattr(vmem, "budget", lambda: decode)
        step = lambda *a: decode_kernel.ssd_decode.__wrapped__(*a, head_block=hb_dec)
        compile_for(mesh, step, *ssd_args(mesh, 16, 16, H, G, P_, N, dtype, 128))
