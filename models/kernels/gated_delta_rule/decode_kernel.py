"""The Gated DeltaNet one-token decode update as a Pallas TPU kernel (``gdn_decode``),
slot-indexed like ``kernel.gdn_ragged``: grid (head block, sequence), each sequence's state
read from its slot by a BlockSpec that follows the slot table and written back by a
double-buffered DMA, so the state is read and written once (``slot_update``, shared with the
SSD kernel; this module holds the step). Reference: ``reference.gdn_decode_step`` (and the
sequential recurrence).

As in the SSD decode kernel, every load and store is static: the wrapper gathers each
sequence's one token row into per-sequence arrays whose block for sequence ``s`` is a whole
dimension, and scatters o back to the token rows afterwards::

    q, k [T, H, Dk] --q[rows]--> [S, 1, H*Dk]     block (None, 1, HB*Dk) at (s, 0, hb)
    v    [T, H, Dv] ----------> [S, 1, H*Dv]     block (None, 1, HB*Dv)
    g    [T, H]     ----------> [S, H/HB, 1, HB] block (None, None, 1, HB)
    o    [S, 1, H*Dv] --.at[rows].set--> [T, H, Dv], rows of padding sequences left 0
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hicache_jax.models.kernels import slot_update
from hicache_jax.models.kernels.gated_delta_rule.kernel import _check, decode_cost, pick_head_block
from hicache_jax.models.kernels.mamba2_ssd.kernel import F32, HIGHEST, _dot


def _step(blocks, state_ref, fresh, o_ref, put_state, *, precision) -> None:
    """One sequence's update of its head block (a ``slot_update.Step``): state_ref
    [HB, Dk, Dv], o_ref [1, HB*Dv]."""
    # q and k [1, HB*Dk], v [1, HB*Dv], g and beta [1, HB]
    q_ref, k_ref, v_ref, g_ref, beta_ref = blocks
    HB, Dk, Dv = state_ref.shape
    qr, kr, vr = (r[...].astype(F32) for r in (q_ref, k_ref, v_ref))  # [1, HB*D]
    decay = jnp.exp(g_ref[...])  # [1, HB]
    beta = beta_ref[...]  # [1, HB]
    for h in range(HB):
        qh, kh = qr[:, h * Dk : (h + 1) * Dk], kr[:, h * Dk : (h + 1) * Dk]  # [1, Dk]
        vh = vr[:, h * Dv : (h + 1) * Dv]  # [1, Dv]
        old = decay[:, h : h + 1] * jnp.where(fresh, 0.0, state_ref[h])  # [Dk, Dv]
        delta = beta[:, h : h + 1] * (vh - _dot(kh, old, (1, 0), precision))  # [1, Dv]
        new = old + _dot(kh, delta, (0, 0), precision)  # [Dk, Dv]: old + outer(k, delta)
        put_state(h, new)
        o_ref[:, h * Dv : (h + 1) * Dv] = _dot(qh, new, (1, 0), precision)  # [1, Dv]


@functools.partial(jax.jit, static_argnames=("head_block", "precision", "interpret"))
def gdn_decode(
    q: jax.Array,  # [T, H, Dk] l2-normalised, scaled by Dk ** -0.5
    k: jax.Array,  # [T, H, Dk] l2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H] log-decay, <= 0
    beta: jax.Array,  # [T, H]
    cu_seqlens: jax.Array,  # [S + 1]; sequence s's one token is row cu_seqlens[s]
    num_seqs: jax.Array,  # []
    states: jax.Array,  # [num_slots, H, Dk, Dv] float32
    slots: jax.Array,  # [S] int32, -1: none
    has_initial_state: jax.Array,  # [S] bool
    *,
    head_block: int | None = None,
    precision: lax.Precision = HIGHEST,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # o [T, H, Dv] float32, updated states
    """One-token Gated DeltaNet update for a decode-only batch, slot-indexed like
    ``gdn_ragged``; each state is read and written once (``slot_update``)."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = slots.shape[0]
    HB = head_block or pick_head_block(H, Dk, Dv, q.dtype)
    _check(states, HB, H)

    tab = slot_update.tables(cu_seqlens, num_seqs, slots, has_initial_state, num_rows=T)
    k_cols = pl.BlockSpec((None, 1, HB * Dk), lambda hb, s, *_: (s, 0, hb))
    v_cols = pl.BlockSpec((None, 1, HB * Dv), lambda hb, s, *_: (s, 0, hb))
    head_spec = pl.BlockSpec((None, None, 1, HB), lambda hb, s, *_: (s, hb, 0, 0))
    per_head = lambda a: a.astype(F32)[tab.rows].reshape(S, H // HB, 1, HB)
    blocks = [  # (operand, its block spec), in _step's order
        (q[tab.rows].reshape(S, 1, H * Dk), k_cols),  # q [S, 1, H*Dk]
        (k[tab.rows].reshape(S, 1, H * Dk), k_cols),  # k [S, 1, H*Dk]
        (v[tab.rows].reshape(S, 1, H * Dv), v_cols),  # v [S, 1, H*Dv]
        (per_head(g), head_spec),  # g [S, H/HB, 1, HB]
        (per_head(beta), head_spec),  # beta [S, H/HB, 1, HB]
    ]
    return slot_update.slot_update(
        functools.partial(_step, precision=precision),
        tab,
        blocks,
        v_cols,  # o
        states,
        num_rows=T,
        head_block=HB,
        out_dim=Dv,
        cost=decode_cost(S, H, Dk, Dv, q.dtype),
        interpret=interpret,
    )
