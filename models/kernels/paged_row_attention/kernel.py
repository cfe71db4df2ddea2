"""Attention over per-token row lists of a paged pool as a Pallas TPU kernel.

Same interface and semantics as ``reference.py``; runs on TPU (Mosaic) and, with
``interpret=True``, on CPU. Grid: one step per query token. A token's flat row ids
(``reference.row_ids``, padded with -1 to blocks of ``block_rows``) are copied into SMEM;
its rows are then copied from the pool in HBM, one DMA each, into a double-buffered VMEM
block (block ``j + 1`` in flight while block ``j`` is scored), with an online softmax over
the blocks::

    ids[t]    [ r0 r1 ... r127 | r128 ... r255 | ... | -1 -1 ... ]
    blocks    [ copied, scored | copied, scored |     | skipped   ]   up to the last valid id

**Row groups.** Mosaic slices an HBM pool only at its sublane packing: a float32 row is its
own slice, but bfloat16 rows pack in pairs (two rows share each 32-bit word), so a 16-bit
row is copied with its pair partner (``G = 2`` rows, twice the bytes); an 8-bit row (a
quantized pool) with its three partners (``G = 4``), then widened in VMEM. The buffer holds
``block_rows * G`` rows; the score mask (``[1, block_rows * G]``, built beside the ids)
keeps each listed row and drops its partner.

Blocks past the token's last valid id are neither copied nor scored; an invalid id copies
nothing. Rows a token does not keep (stale buffer rows, pair partners) may hold anything,
NaN included: their scores are masked, and the buffer is made finite before the
probabilities meet it (``0 * NaN`` would survive).

VMEM: ``2 x block_rows x G x D`` pool elements, the token's ``[H, D]`` query and output
blocks (double-buffered by Pallas) and its mask row.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import vmem
from hicache_jax.models.kernels.paged_row_attention.reference import row_ids

NEG_INF = float("-inf")
LANES = 128
BLOCK_ROWS = 128  # rows per double-buffered block


def group_rows(dtype) -> int:
    """Rows one copy moves: the pool's sublane packing (2 for 16-bit rows, else 1)."""
    return max(1, 4 // jnp.dtype(dtype).itemsize)


def cost(T: int, H: int, N: int, D: int, G: int, dtype, q_dtype) -> pl.CostEstimate:
    """The static bound: every token scores all ``N`` listed rows (their ``G``-row groups);
    a block past its last valid id is skipped at run time."""
    item = jnp.dtype(dtype).itemsize
    return pl.CostEstimate(
        flops=4 * T * H * N * G * D,
        transcendentals=T * H * N * G,
        bytes_accessed=T * N * (G * D * item + 4 + 4 * G)
        + T * H * D * (jnp.dtype(q_dtype).itemsize + 4)
        + T * H * 4,
    )


def _kernel(
    nblk_ref,  # SMEM [T] (scalar prefetch): blocks up to the token's last valid id
    ids_hbm,  # ANY [T * N] int32: flat row ids, -1 none
    keep_ref,  # VMEM [1, 1, N * G] int32: 1 where row (i, g) of the buffer is listed row i
    q_ref,  # VMEM [1, H, D]
    pages_hbm,  # ANY [num_pages, rows, D], read in place
    o_ref,  # VMEM [1, H, D] f32
    lse_ref,  # VMEM [1, H, 1] f32
    ids_smem,  # SMEM [N] int32
    ids_sem,
    buf,  # VMEM [2, block_rows, G, D]
    sems,  # DMA [2]
    *,
    sm_scale: float,
):
    t = pl.program_id(0)
    N = ids_smem.shape[0]
    _, bn, G, D = buf.shape
    H = q_ref.shape[1]
    nb = nblk_ref[t]

    def copies(j, slot, action):
        def each(r, carry):
            row = ids_smem[j * bn + r]

            @pl.when(row >= 0)
            def _row():
                R = pages_hbm.shape[1]
                src = pages_hbm.at[row // R, pl.ds(pl.multiple_of(row % R // G * G, G), G)]
                action(pltpu.make_async_copy(src, buf.at[slot, r], sems.at[slot]))

            return carry

        lax.fori_loop(0, bn, each, 0)

    @pl.when(nb == 0)
    def _empty():
        o_ref[...] = jnp.zeros_like(o_ref)
        lse_ref[...] = jnp.full_like(lse_ref, NEG_INF)

    @pl.when(nb > 0)
    def _attend():
        ids_copy = pltpu.make_async_copy(
            ids_hbm.at[pl.ds(pl.multiple_of(t * N, LANES), N)], ids_smem, ids_sem
        )
        ids_copy.start()
        ids_copy.wait()
        copies(0, 0, lambda c: c.start())
        q = q_ref[0]  # [H, D]
        # 8-bit pages are widened after the copy to the queries' dtype (exact); wider pages
        # meet the queries in their own dtype.
        quantized = jnp.dtype(buf.dtype).itemsize == 1
        cdt = q.dtype if quantized else buf.dtype
        f32 = cdt == jnp.float32
        # Explicit, so jax_default_matmul_precision=highest (the tests') cannot ask Mosaic for
        # an f32 contraction of bf16 operands, which it refuses.
        precision = lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT
        q = q.astype(cdt)

        def step(j, carry):
            m, l, acc = carry
            slot = j % 2

            @pl.when(j + 1 < nb)
            def _next():
                copies(j + 1, 1 - slot, lambda c: c.start())

            copies(j, slot, lambda c: c.wait())
            k = buf[slot].reshape(bn * G, D)
            if quantized:
                k = k.astype(jnp.float32).astype(cdt)
            keep = keep_ref[0, :, pl.ds(pl.multiple_of(j * bn * G, LANES), bn * G)] > 0  # [1, bn * G]
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # [H, bn * G]
            s = jnp.where(keep, s * sm_scale, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe)  # 0 where not kept
            alpha = jnp.exp(m - m_safe)
            # Stale rows and pair partners may be NaN: finite before they meet p.
            v = jnp.where(jnp.isfinite(k.astype(jnp.float32)), k, jnp.zeros_like(k))
            pv = lax.dot_general(
                p.astype(k.dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )  # [H, D]
            return m_new, alpha * l + p.sum(axis=-1, keepdims=True), alpha * acc + pv

        init = (
            jnp.full((H, 1), NEG_INF, jnp.float32),
            jnp.zeros((H, 1), jnp.float32),
            jnp.zeros((H, D), jnp.float32),
        )
        m, l, acc = lax.fori_loop(0, nb, step, init)
        empty = l == 0.0
        o_ref[0] = acc / jnp.where(empty, 1.0, l)
        lse_ref[0] = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, l)))


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_rows", "interpret"))
def paged_row_attention(
    q: jax.Array,  # [T, H, D]
    pages: jax.Array,  # [num_pages, rows, D]
    table: jax.Array,  # [S, max_pages] int32
    seq: jax.Array,  # [T] int32
    idx: jax.Array,  # [T, N] int32: rows within the sequence; < 0: none
    *,
    sm_scale: float,
    block_rows: int = BLOCK_ROWS,
    interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:  # o [T, H, D] f32, lse [T, H] f32
    T, H, D = q.shape
    num_pages, R, Dp = pages.shape
    packing = group_rows(pages.dtype)
    G = packing if R % packing == 0 else 1  # one row a page: always its own slice
    if Dp != D:
        raise ValueError(f"queries are {D} wide, the pool's rows {Dp}")
    if block_rows % LANES:
        raise ValueError(f"block_rows={block_rows} must be a multiple of {LANES}")
    if G < packing and R > 1 and not interpret:
        raise ValueError(f"{R} rows a page of {pages.dtype.name}: Mosaic copies rows in groups of {packing}")
    N = idx.shape[1]
    Np = -(-N // block_rows) * block_rows
    flat = jnp.pad(row_ids(table, seq, idx, R), ((0, 0), (0, Np - N)), constant_values=-1)  # [T, Np]
    pos = jnp.arange(Np, dtype=jnp.int32)
    last = jnp.max(jnp.where(flat >= 0, pos, -1), axis=1)  # [T]: -1 when none
    nblk = jnp.where(last >= 0, last // block_rows + 1, 0).astype(jnp.int32)
    # Buffer row (i, g) is row g of listed row i's group: kept where that is the row itself.
    part = jnp.arange(G, dtype=jnp.int32)
    keep = (flat >= 0)[..., None] & (flat[..., None] % G == part)  # [T, Np, G]
    keep = keep.astype(jnp.int32).reshape(T, 1, Np * G)
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    per_token = pl.BlockSpec((1, H, D), lambda t, *_: (t, 0, 0))
    o, lse = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(T,),
            in_specs=[any_space, pl.BlockSpec((1, 1, Np * G), lambda t, *_: (t, 0, 0)), per_token, any_space],
            out_specs=[per_token, pl.BlockSpec((1, H, 1), lambda t, *_: (t, 0, 0))],
            scratch_shapes=[
                pltpu.SMEM((Np,), jnp.int32),
                pltpu.SemaphoreType.DMA(()),
                pltpu.VMEM((2, block_rows, G, D), pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((T, H, D), jnp.float32),
            jax.ShapeDtypeStruct((T, H, 1), jnp.float32),
        ],
        # Every step starts and drains its own copies, so steps may run in any order.
        compiler_params=vmem.compiler_params(("parallel",)),
        cost_estimate=cost(T, H, Np, D, G, pages.dtype, q.dtype),
        interpret=interpret,
    )(nblk, flat.reshape(-1), keep, q, vmem.in_hbm(pages, interpret))
    return o, lse[..., 0]
