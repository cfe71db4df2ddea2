"""A lightning indexer's scores over a paged key pool as a Pallas TPU kernel.

Same interface and semantics as ``reference.py``; runs on TPU (Mosaic) and, with
``interpret=True``, on CPU. It writes the float32 scores ``[T, N]`` and leaves
``lax.top_k`` to XLA: a score is 4 bytes a row against the key's ``d`` elements
(256 bytes at V4's 128 of bfloat16), so writing them costs little beside reading the keys,
and a running top-k inside the kernel would be a sort network per block.

**Work items.** The tokens are taken ``block_q`` at a time (32; 1 for a decode step, whose
tokens are each another sequence's: every token of an item is scored against its keys,
so a block of 32 decode tokens would cost 32 times the matmuls); a block may span several
sequences (a ragged decode+prefill step), so each (query block, sequence it holds) is one
work item, at most ``T / block_q + S`` of them. Grid: ``(item, key block)``. A step copies
its sequence's ``block_rows / rows`` pages of the key block straight from the pool in HBM
(one DMA a page, all in flight together; the pool is read in place, no gather copy),
scores all the block's tokens against them (``[block_q * Hi, d] x [d, block_rows]``, relu,
then each token's head weights) and keeps the tokens of that sequence that see each row.
Key blocks past the last row any token of the item sees are neither copied nor scored::

    item (block i, seq s)   key blocks  [ copy, score | copy, score | -inf | -inf ... ]
                                                      ^ last row the item's tokens see

Each item writes its own ``[block_q, N]`` scores; a token's row is then taken from its
item. Rows a token does not see (unused pages, stale rows: NaN allowed) are ``-inf``; a
key row only ever reaches its own score column, so a NaN row stays in its masked column.

8-bit (quantized) keys are copied as they are and widened after the copy; the queries then
stay in their own dtype (``reference.meet_dtype``).

VMEM: ``block_rows x d`` keys, the block's ``[block_q * Hi, d]`` queries and
``[block_q, Hi]`` weights (double-buffered by Pallas), the ``[block_q * Hi, block_rows]``
float32 products and the ``[block_q, block_rows]`` output block.
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
from hicache_jax.models.kernels.index_scores.reference import meet_dtype

NEG_INF = float("-inf")
LANES = 128
BLOCK_Q = 32  # tokens a query block (1 when the step has no more tokens than sequences)
BLOCK_ROWS = 512  # key rows a step


def work_items(seq: jax.Array, last: jax.Array, num_seqs: int, block_q: int, block_rows: int):
    """``(item_block, item_seq, item_blocks, token_item)``: for each of the static
    ``T / block_q + num_seqs`` items its query block, its sequence and the key blocks it
    reads (0: none, also for unused items); for each token the item holding its scores."""
    nb = seq.shape[0] // block_q
    live = last >= 0
    s = seq.reshape(nb, block_q)
    lo = jnp.min(jnp.where(live, seq, num_seqs).reshape(nb, block_q), axis=1)
    hi = jnp.max(jnp.where(live, seq, -1).reshape(nb, block_q), axis=1)
    count = jnp.maximum(hi - lo + 1, 0)
    ends = jnp.cumsum(count)
    starts = ends - count
    W = nb + num_seqs
    w = jnp.arange(W, dtype=jnp.int32)
    blk = jnp.minimum(jnp.searchsorted(ends, w, side="right"), nb - 1).astype(jnp.int32)
    used = w < ends[-1]
    iseq = jnp.where(used, lo[blk] + w - starts[blk], 0).astype(jnp.int32)
    mine = (s[blk] == iseq[:, None]) & live.reshape(nb, block_q)[blk]  # [W, block_q]
    reach = jnp.max(jnp.where(mine, last.reshape(nb, block_q)[blk], -1), axis=1)
    nblk = jnp.where(used & (reach >= 0), reach // block_rows + 1, 0).astype(jnp.int32)
    t = jnp.arange(seq.shape[0])
    token_item = jnp.where(live, starts[t // block_q] + seq - lo[t // block_q], 0)
    return blk, iseq, nblk, token_item.astype(jnp.int32)


def cost(W: int, block_q: int, H: int, N: int, d: int, dtype, q_dtype) -> pl.CostEstimate:
    """The static bound: every item reads and scores all ``N`` rows of its sequence (a key
    block past its tokens' last row is skipped at run time) and writes its scores."""
    return pl.CostEstimate(
        flops=2 * W * block_q * H * N * (d + 1),
        transcendentals=0,
        bytes_accessed=W * N * d * jnp.dtype(dtype).itemsize
        + W * block_q * (H * d * jnp.dtype(q_dtype).itemsize + H * 4 + 8 + N * 4),
    )


def _kernel(
    blk_ref,  # SMEM [W] (scalar prefetch): each item's query block
    seq_ref,  # SMEM [W]: its sequence
    nblk_ref,  # SMEM [W]: key blocks it reads
    table_ref,  # SMEM [S * max_pages]: page tables, flat
    tok_ref,  # VMEM [1, block_q, 2] int32: each token's sequence and last row
    q_ref,  # VMEM [1, block_q * H, d]
    w_ref,  # VMEM [1, block_q, H] f32
    keys_hbm,  # ANY [num_pages, rows, d], read in place
    o_ref,  # VMEM [1, block_q, block_rows] f32
    buf,  # VMEM [pages a block, rows, d]
    sems,  # DMA [pages a block]
    *,
    max_pages: int,
):
    item, j = pl.program_id(0), pl.program_id(1)
    bp, R, d = buf.shape
    bq, H = w_ref.shape[1], w_ref.shape[2]
    s = seq_ref[item]

    @pl.when(j >= nblk_ref[item])
    def _unseen():
        o_ref[...] = jnp.full_like(o_ref, NEG_INF)

    @pl.when(j < nblk_ref[item])
    def _score():
        def copy(p):
            page = table_ref[s * max_pages + j * bp + p]
            return pltpu.make_async_copy(keys_hbm.at[page], buf.at[p], sems.at[p])

        for p in range(bp):
            copy(p).start()
        for p in range(bp):
            copy(p).wait()
        k = buf[...].reshape(bp * R, d)
        if k.dtype != q_ref.dtype:  # 8-bit keys, widened in VMEM (exact in the queries' dtype)
            k = k.astype(jnp.float32).astype(q_ref.dtype)
        f32 = k.dtype == jnp.float32
        precision = lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT
        qk = lax.dot_general(
            q_ref[0], k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [bq * H, bp * R]
        qk = jnp.maximum(qk, 0.0)
        for b in range(bq):
            o_ref[0, pl.ds(b, 1), :] = lax.dot_general(
                w_ref[0, pl.ds(b, 1), :],
                qk[b * H : (b + 1) * H],
                (((1,), (0,)), ((), ())),
                precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )
        tok = tok_ref[0]  # [bq, 2]
        pos = j * bp * R + lax.broadcasted_iota(jnp.int32, (bq, bp * R), 1)
        keep = (tok[:, 0:1] == s) & (pos <= tok[:, 1:2])
        o_ref[0] = jnp.where(keep, o_ref[0], NEG_INF)


def check_shapes(rows: int, d: int, dtype, block_rows: int = BLOCK_ROWS) -> None:
    """Shapes Mosaic compiles: whole pages a key block, a key block of whole lanes."""
    if block_rows % LANES or block_rows % rows:
        raise ValueError(f"block_rows={block_rows}: a multiple of {LANES} and of the {rows} rows a page")
    tile = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
    if rows % tile:
        name = jnp.dtype(dtype).name
        raise ValueError(f"{rows} index rows a page of {name}: Mosaic needs a multiple of {tile}")
    if d % LANES:
        raise ValueError(f"index keys {d} wide: Mosaic needs a multiple of {LANES}")


@functools.partial(jax.jit, static_argnames=("block_q", "block_rows", "interpret"))
def index_scores(
    q: jax.Array,  # [T, Hi, d]
    w: jax.Array,  # [T, Hi]
    keys: jax.Array,  # [num_pages, rows, d]
    table: jax.Array,  # [S, max_pages] int32
    seq: jax.Array,  # [T] int32
    last: jax.Array,  # [T] int32: the last row each token sees (-1: none)
    *,
    block_q: int | None = None,
    block_rows: int = BLOCK_ROWS,
    interpret: Any = False,
) -> jax.Array:  # [T, max_pages * rows] float32
    T, H, d = q.shape
    num_pages, R, dk = keys.shape
    S, max_pages = table.shape
    if dk != d:
        raise ValueError(f"index queries are {d} wide, the keys {dk}")
    if w.shape != (T, H):
        raise ValueError(f"weights {w.shape}, expected {(T, H)}")
    if block_q is None:  # decode (a token a sequence): a block each, no query scored twice
        block_q = 1 if T <= S else BLOCK_Q
    block_rows = max(block_rows, R)  # at least one page a block
    if not interpret:
        check_shapes(R, d, keys.dtype, block_rows)
    elif block_rows % R:
        raise ValueError(f"block_rows={block_rows} must be a multiple of the {R} rows a page")
    bp = block_rows // R
    N = max_pages * R
    nk = -(-max_pages // bp)
    Tp = -(-T // block_q) * block_q
    pad = Tp - T
    seq = jnp.pad(jnp.clip(seq, 0, S - 1).astype(jnp.int32), (0, pad))
    last = jnp.pad(last.astype(jnp.int32), (0, pad), constant_values=-1)
    blk, iseq, nblk, token_item = work_items(seq, last, S, block_q, block_rows)
    W = blk.shape[0]
    flat_table = jnp.pad(jnp.clip(table, 0, num_pages - 1), ((0, 0), (0, nk * bp - max_pages)))
    nb = Tp // block_q
    meet = meet_dtype(keys.dtype, q.dtype)
    qb = jnp.pad(q.astype(meet), ((0, pad), (0, 0), (0, 0))).reshape(nb, block_q * H, d)
    wb = jnp.pad(w.astype(jnp.float32), ((0, pad), (0, 0))).reshape(nb, block_q, H)
    tok = jnp.stack([seq, last], axis=1).reshape(nb, block_q, 2)
    by_block = lambda shape: pl.BlockSpec((1, *shape), lambda i, j, blk, *_: (blk[i], 0, 0))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, max_pages=nk * bp),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(W, nk),
            in_specs=[
                by_block((block_q, 2)),
                by_block((block_q * H, d)),
                by_block((block_q, H)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((1, block_q, block_rows), lambda i, j, *_: (i, 0, j)),
            scratch_shapes=[pltpu.VMEM((bp, R, d), keys.dtype), pltpu.SemaphoreType.DMA((bp,))],
        ),
        out_shape=jax.ShapeDtypeStruct((W, block_q, nk * block_rows), jnp.float32),
        # Every step starts and drains its own copies, so steps may run in any order.
        compiler_params=vmem.compiler_params(("parallel", "parallel")),
        cost_estimate=cost(W, block_q, H, nk * block_rows, d, keys.dtype, meet),
        interpret=interpret,
    )(blk, iseq, nblk, flat_table.reshape(-1), tok, qb, wb, vmem.in_hbm(keys, interpret))
    scores = out[token_item, jnp.arange(Tp) % block_q, :N]
    return jnp.where(last[:, None] >= 0, scores, NEG_INF)[:T]
