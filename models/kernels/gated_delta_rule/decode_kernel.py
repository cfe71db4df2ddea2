"""The Gated DeltaNet one-token decode update as a Pallas TPU kernel (``gdn_decode``),
slot-indexed like ``kernel.gdn_ragged``: grid (head block, sequence), each sequence's state
read from its slot by a BlockSpec that follows the slot table and written back by a
double-buffered DMA, so the state is read and written once. Reference:
``reference.gdn_decode_step`` (and the sequential recurrence).

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
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import vmem
from hicache_jax.models.kernels.gated_delta_rule.kernel import _check, decode_cost, pick_head_block
from hicache_jax.models.kernels.mamba2_ssd.kernel import F32, HIGHEST, _dot


def _decode_kernel(
    # scalar prefetch (SMEM)
    slots_ref,  # [S] slot to write (-1: none, or padding)
    init_ref,  # [S] 1: start from the slot's state
    read_ref,  # [S] slot whose block the pipeline fetches (see gdn_decode)
    # blocks: sequence s's token, this head block's part of it
    q_ref,  # [1, HB*Dk]
    k_ref,  # [1, HB*Dk]
    v_ref,  # [1, HB*Dv]
    g_ref,  # [1, HB]
    beta_ref,  # [1, HB]
    state_ref,  # [HB, Dk, Dv] states[read[s], head block], double-buffered by Pallas
    o_ref,  # [1, HB*Dv]
    states_out,  # [num_slots, H, Dk, Dv] HBM, aliases the state pool
    out_scr,  # [2, HB, Dk, Dv] f32: new states, written back while the next sequence runs
    sems,  # [2] DMA semaphores
    pending,  # [2] int32 SMEM: a write-back from out_scr[i] is in flight
    *,
    precision,
):
    hb, s = pl.program_id(0), pl.program_id(1)
    S = pl.num_programs(1)
    HB, Dk, Dv = state_ref.shape
    heads = pl.ds(hb * HB, HB)
    buf = lax.rem(s, 2)

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
    qr, kr, vr = (r[...].astype(F32) for r in (q_ref, k_ref, v_ref))  # [1, HB*D]
    decay = jnp.exp(g_ref[...])  # [1, HB]
    beta = beta_ref[...]  # [1, HB]
    for h in range(HB):
        qh, kh = qr[:, h * Dk : (h + 1) * Dk], kr[:, h * Dk : (h + 1) * Dk]  # [1, Dk]
        vh = vr[:, h * Dv : (h + 1) * Dv]  # [1, Dv]
        old = decay[:, h : h + 1] * jnp.where(fresh, 0.0, state_ref[h])  # [Dk, Dv]
        delta = beta[:, h : h + 1] * (vh - _dot(kh, old, (1, 0), precision))  # [1, Dv]
        new = old + _dot(kh, delta, (0, 0), precision)  # [Dk, Dv]: old + outer(k, delta)
        out_scr[buf, h] = new
        o_ref[:, h * Dv : (h + 1) * Dv] = _dot(qh, new, (1, 0), precision)  # [1, Dv]

    @pl.when(slot >= 0)
    def _():
        copy(buf, slot).start()
        pending[buf] = 1

    @pl.when(s == S - 1)  # leave nothing in flight when the head block ends
    def _():
        drain(0)
        drain(1)


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
    ``gdn_ragged``.

    Grid = (head block, sequence). Decode is bound by the state pool's bytes, so the state
    read goes through a BlockSpec whose index map follows the slots (Pallas prefetches the
    next sequence's state while this one computes) and the write-back is an async DMA that
    overlaps the next sequence."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = slots.shape[0]
    HB = head_block or pick_head_block(H, Dk, Dv, q.dtype)
    _check(states, HB, H)

    s_idx = jnp.arange(S, dtype=jnp.int32)
    live = s_idx < num_seqs
    rows = jnp.clip(cu_seqlens[:-1], 0, T - 1).astype(jnp.int32)  # [S]
    write = jnp.where(live, slots, -1).astype(jnp.int32)  # [S]
    init = (live & (slots >= 0) & has_initial_state).astype(jnp.int32)  # [S]
    # A sequence that reads nothing re-uses the previous read's block index, so the pipeline
    # issues no DMA for it.
    reader = lax.cummax(jnp.where(init > 0, s_idx, -1), axis=0)  # [S]
    read = jnp.where(reader >= 0, write[jnp.maximum(reader, 0)], 0)  # [S]

    k_cols = pl.BlockSpec((None, 1, HB * Dk), lambda hb, s, *_: (s, 0, hb))
    v_cols = pl.BlockSpec((None, 1, HB * Dv), lambda hb, s, *_: (s, 0, hb))
    head_spec = pl.BlockSpec((None, None, 1, HB), lambda hb, s, *_: (s, hb, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(H // HB, S),
        in_specs=[
            k_cols,  # q
            k_cols,  # k
            v_cols,  # v
            head_spec,  # g
            head_spec,  # beta
            pl.BlockSpec((None, HB, Dk, Dv), lambda hb, s, wr, init, rd: (rd[s], hb, 0, 0)),
        ],
        out_specs=[
            v_cols,  # o
            pl.BlockSpec(memory_space=pl.ANY),  # states
        ],
        scratch_shapes=[
            pltpu.VMEM((2, HB, Dk, Dv), F32),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((2,), jnp.int32),
        ],
    )
    per_head = lambda a: a.astype(F32)[rows].reshape(S, H // HB, 1, HB)
    o_seq, states = pl.pallas_call(
        functools.partial(_decode_kernel, precision=precision),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((S, 1, H * Dv), F32),
            jax.ShapeDtypeStruct(states.shape, states.dtype),
        ],
        input_output_aliases={8: 1},  # 3 scalar-prefetch operands, then q k v g beta states
        compiler_params=vmem.compiler_params(("parallel", "arbitrary")),
        cost_estimate=decode_cost(S, H, Dk, Dv, q.dtype),
        interpret=interpret,
    )(
        write,
        init,
        read.astype(jnp.int32),
        q[rows].reshape(S, 1, H * Dk),
        k[rows].reshape(S, 1, H * Dk),
        v[rows].reshape(S, 1, H * Dv),
        per_head(g),
        per_head(beta),
        vmem.in_hbm(states, interpret),
    )
    dest = jnp.where(live, rows, T)  # padding sequences write no o row
    o = jnp.zeros((T, H, Dv), F32).at[dest].set(o_seq.reshape(S, H, Dv), mode="drop")
    return o, states
