"""The Mamba2 one-token decode update as a Pallas TPU kernel (``ssd_decode``), slot-indexed
like ``kernel.ssd_ragged``: grid (head block, sequence), each sequence's state read from its
slot by a BlockSpec that follows the slot table and written back by a double-buffered DMA
(``slot_update``, shared with the Gated DeltaNet kernel; this module holds the step).
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

from hicache_jax.models.kernels import slot_update
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


def _step(blocks, state_ref, fresh, y_ref, put_state, *, hpg: int, precision) -> None:
    """One sequence's update of its head block (a ``slot_update.Step``): state_ref
    [HB, P, N], y_ref [1, HB*P]."""
    # x [1, HB*P], dt and A [1, HB], B and C [GB, 1, N], D [1, HB]
    x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref = blocks
    HB, P, N = state_ref.shape
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
        put_state(h, new)  # [P, N]
        y_ref[:, h * P : (h + 1) * P] = _dot(cg, new, (1, 1), precision) + d_row[:, h : h + 1] * xh


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
    """One-token SSD update for a decode-only batch, slot-indexed like ``ssd_ragged``; each
    state is read and written once (``slot_update``)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = slots.shape[0]
    _check(states)
    HB = head_block or pick_head_block(H, G, P, N, x.dtype)
    GB, hpg = _group_block(H, G, HB)

    tab = slot_update.tables(cu_seqlens, num_seqs, slots, has_initial_state, num_rows=T)
    gblk = functools.partial(_group_blk, head_block=HB, hpg=hpg, groups_per_block=GB)
    row_cols = pl.BlockSpec((None, 1, HB * P), lambda hb, s, *_: (s, 0, hb))
    dt_spec = pl.BlockSpec((None, None, 1, HB), lambda hb, s, *_: (s, hb, 0, 0))
    group_spec = pl.BlockSpec((None, GB, 1, N), lambda hb, s, *_: (s, gblk(hb), 0, 0))
    head_spec = pl.BlockSpec((None, 1, HB), lambda hb, s, *_: (hb, 0, 0))
    per_seq = lambda v: v[tab.rows][:, :, None]  # [T, G, N] -> [S, G, 1, N]
    blocks = [  # (operand, its block spec), in _step's order
        (x[tab.rows].reshape(S, 1, H * P), row_cols),  # x [S, 1, H*P]
        (dt.astype(F32)[tab.rows].reshape(S, H // HB, 1, HB), dt_spec),  # dt [S, H/HB, 1, HB]
        (_head_major(A.astype(F32)[None], HB), head_spec),  # A [H/HB, 1, HB]
        (per_seq(B), group_spec),  # B [S, G, 1, N]
        (per_seq(C), group_spec),  # C [S, G, 1, N]
        (_head_major(D.astype(F32)[None], HB), head_spec),  # D [H/HB, 1, HB]
    ]
    return slot_update.slot_update(
        functools.partial(_step, hpg=hpg, precision=precision),
        tab,
        blocks,
        row_cols,  # y
        states,
        num_rows=T,
        head_block=HB,
        out_dim=P,
        cost=decode_cost(S, H, P, N, G, HB, x.dtype),
        interpret=interpret,
    )
