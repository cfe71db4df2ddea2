"""The Mamba2 one-token decode update as a Pallas TPU kernel (``ssd_decode``), slot-indexed
like ``kernel.ssd_ragged``: grid (head block, sequence), each sequence's state read from its
slot by a BlockSpec that follows the slot table and written back by a double-buffered DMA.
Reference: ``reference.ssd_decode_step`` (and the sequential recurrence).

Every load and store in the kernel is static. The wrapper gathers each sequence's one token
row into per-sequence arrays (a few KiB for a decode batch) whose block for sequence ``s`` is
a whole dimension, and scatters y back to the token rows afterwards::

    x  [T, H, P] --x[rows]--> [S, 1, H*P]     block (None, 1, HB*P) at (s, 0, hb)
    dt [T, H]    ----------> [S, H/HB, 1, HB] block (None, None, 1, HB)
    B  [T, G, N] ----------> [S, G, 1, N]     block (None, GB, 1, N)
    y  [S, 1, H*P] --.at[rows].set--> [T, H, P], rows of padding sequences left 0

(A dynamic one-row slice ``x_ref[row]`` of a [T, *] block is what Mosaic refuses: it
cannot prove a bf16 row index a multiple of the 16-row tile, nor store an unaligned f32 row.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import vmem
from hicache_jax.models.kernels.mamba2_ssd.kernel import (
    F32,
    HIGHEST,
    _check,
    _dot,
    _group_blk,
    _group_block,
    _head_major,
    decode_cost,
    pick_head_block,
)


def _decode_kernel(
    # scalar prefetch (SMEM)
    slots_ref,  # [S] slot to write (-1: none, or padding)
    init_ref,  # [S] 1: start from the slot's state
    read_ref,  # [S] slot whose block the pipeline fetches (see ssd_decode)
    # blocks: sequence s's token, this head block's part of it
    x_ref,  # [1, HB*P]
    dt_ref,  # [1, HB]
    a_ref,  # [1, HB]
    b_ref,  # [GB, 1, N]
    c_ref,  # [GB, 1, N]
    d_ref,  # [1, HB]
    state_ref,  # [HB, P, N] states[read[s], head block], double-buffered by Pallas
    y_ref,  # [1, HB*P]
    states_out,  # [num_slots, H, P, N] HBM, aliases the state pool
    out_scr,  # [2, HB, P, N] f32: new states, written back while the next sequence runs
    sems,  # [2] DMA semaphores
    pending,  # [2] int32 SMEM: a write-back from out_scr[i] is in flight
    *,
    hpg: int,
    precision,
):
    hb, s = pl.program_id(0), pl.program_id(1)
    S = pl.num_programs(1)
    HB, P, N = state_ref.shape
    heads = pl.ds(hb * HB, HB)
    buf = lax.rem(s, 2)  # (lax.rem/div, not % and //: indices are >= 0, no sign fix-up)

    def copy(i, slot):
        return pltpu.make_async_copy(out_scr.at[i], states_out.at[slot, heads], sems.at[i])

    def drain(i):
        @pl.when(pending[i] != 0)
        def _():
            copy(i, 0).wait()  # the wait only needs the byte count and the semaphore
            pending[i] = 0

    @pl.when(s == 0)
    def _():
        pending[0] = 0
        pending[1] = 0

    drain(buf)  # out_scr[buf] was last sent two sequences ago
    slot = slots_ref[s]
    fresh = init_ref[s] == 0  # start from zeros; `where`, not `* 0`, so NaN never leaks
    xr = x_ref[...].astype(F32)  # [1, HB*P]
    dtr = dt_ref[...]  # [1, HB]
    decay = jnp.exp(dtr * a_ref[...])  # [1, HB]
    d_row = d_ref[...]  # [1, HB]
    for h in range(HB):
        g = h // hpg
        xh = xr[:, h * P : (h + 1) * P]  # [1, P]
        bg, cg = b_ref[g].astype(F32), c_ref[g].astype(F32)  # [1, N]
        old = jnp.where(fresh, 0.0, state_ref[h])  # [P, N]
        new = decay[:, h : h + 1] * old + _dot(xh * dtr[:, h : h + 1], bg, (0, 0), precision)
        out_scr[buf, h] = new  # [P, N]
        y_ref[:, h * P : (h + 1) * P] = _dot(cg, new, (1, 1), precision) + d_row[:, h : h + 1] * xh

    @pl.when(slot >= 0)
    def _():
        copy(buf, slot).start()
        pending[buf] = 1

    @pl.when(s == S - 1)  # leave nothing in flight when the head block ends
    def _():
        drain(0)
        drain(1)


@functools.partial(jax.jit, static_argnames=("head_block", "precision", "interpret"))
def ssd_decode(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    D: jax.Array,  # [H]
    cu_seqlens: jax.Array,  # [S + 1]; sequence s's one token is row cu_seqlens[s]
    num_seqs: jax.Array,  # []
    states: jax.Array,  # [num_slots, H, P, N] float32
    slots: jax.Array,  # [S] int32, -1: none
    has_initial_state: jax.Array,  # [S] bool
    *,
    head_block: int | None = None,
    precision: lax.Precision = HIGHEST,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # y [T, H, P] float32, updated states
    """One-token SSD update for a decode-only batch, slot-indexed like ``ssd_ragged``.

    Grid = (head block, sequence). Decode is bound by the state pool's bytes, so the state
    read goes through a BlockSpec whose index map follows the slots (Pallas prefetches the
    next sequence's state while this one computes) and the write-back is an async DMA that
    overlaps the next sequence."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = slots.shape[0]
    _check(states)
    HB = head_block or pick_head_block(H, G, P, N, x.dtype)
    GB, hpg = _group_block(H, G, HB)

    s_idx = jnp.arange(S, dtype=jnp.int32)
    live = s_idx < num_seqs
    rows = jnp.clip(cu_seqlens[:-1], 0, T - 1).astype(jnp.int32)  # [S]
    write = jnp.where(live, slots, -1).astype(jnp.int32)  # [S]
    init = (live & (slots >= 0) & has_initial_state).astype(jnp.int32)  # [S]
    # A sequence that reads nothing re-uses the previous read's block index, so the pipeline
    # issues no DMA for it.
    reader = lax.cummax(jnp.where(init > 0, s_idx, -1), axis=0)  # [S]
    read = jnp.where(reader >= 0, write[jnp.maximum(reader, 0)], 0)  # [S]

    gblk = functools.partial(_group_blk, head_block=HB, hpg=hpg, groups_per_block=GB)
    row_cols = pl.BlockSpec((None, 1, HB * P), lambda hb, s, *_: (s, 0, hb))
    group_spec = pl.BlockSpec((None, GB, 1, N), lambda hb, s, *_: (s, gblk(hb), 0, 0))
    head_spec = pl.BlockSpec((None, 1, HB), lambda hb, s, *_: (hb, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(H // HB, S),
        in_specs=[
            row_cols,  # x
            pl.BlockSpec((None, None, 1, HB), lambda hb, s, *_: (s, hb, 0, 0)),  # dt
            head_spec,  # A
            group_spec,  # B
            group_spec,  # C
            head_spec,  # D
            pl.BlockSpec((None, HB, P, N), lambda hb, s, wr, init, rd: (rd[s], hb, 0, 0)),
        ],
        out_specs=[
            row_cols,  # y
            pl.BlockSpec(memory_space=pl.ANY),  # states
        ],
        scratch_shapes=[
            pltpu.VMEM((2, HB, P, N), F32),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((2,), jnp.int32),
        ],
    )
    per_seq = lambda v: v[rows][:, :, None]  # [T, G, N] -> [S, G, 1, N]
    y_seq, states = pl.pallas_call(
        functools.partial(_decode_kernel, hpg=hpg, precision=precision),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((S, 1, H * P), F32),
            jax.ShapeDtypeStruct(states.shape, states.dtype),
        ],
        input_output_aliases={9: 1},  # 3 scalar-prefetch operands, then x dt A B C D states
        compiler_params=vmem.compiler_params(("parallel", "arbitrary")),
        cost_estimate=decode_cost(S, H, P, N, G, HB, x.dtype),
        interpret=interpret,
    )(
        write,
        init,
        read.astype(jnp.int32),
        x[rows].reshape(S, 1, H * P),
        dt.astype(F32)[rows].reshape(S, H // HB, 1, HB),
        _head_major(A.astype(F32)[None], HB),
        per_seq(B),
        per_seq(C),
        _head_major(D.astype(F32)[None], HB),
        vmem.in_hbm(states, interpret),
    )
    dest = jnp.where(live, rows, T)  # padding sequences write no y row
    y = jnp.zeros((T, H, P), F32).at[dest].set(y_seq.reshape(S, H, P), mode="drop")
    return y, states
