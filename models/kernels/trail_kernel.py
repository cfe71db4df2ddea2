"""A verify chunk's recurrence with its state trail as one Pallas TPU kernel per kind
(``ssd_trail``, ``gdn_trail``): the decode kernels' one-token step (``_step`` of
``mamba2_ssd/decode_kernel.py`` and ``gated_delta_rule/decode_kernel.py``) run over each
sequence's tokens in VMEM, so each state is read once and written once per token that
names a slot. Reference: ``state_trail.trail_reference``.

Signature of the slot-indexed kernels, but ``slots`` is ``[S, 1 + Q]``: each sequence's
working slot, then its trail (``ForwardBatch.state_trail``)::

    grid (head block, sequence s), s's blocks hold its Q token rows:
      read    states[working[s], heads]  (BlockSpec following the slot table)
      j < q_len[s]:
        step  token j from the state after token j - 1 (out_scr[j - 1]) into out_scr[j]
        DMA   out_scr[j] -> states[trail[s, j], heads]         (trail[s, j] >= 0)
        DMA   out_scr[j] -> states[working[s], heads]          (j = q_len[s] - 1)
      wait    for the sequence's DMAs before the next sequence reuses out_scr

Per-token operands are laid out ``[S, Q, 1, ...]`` (per-head ones ``[S, H/HB, Q, 1, HB]``,
B and C ``[S, G, Q, 1, N]``) so token j of a block is an index on an untiled axis, never a
row slice. Trail slots are distinct from each other and from the working slots, so the
pipeline's read of the next sequence's state never meets a write in flight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import slot_update, vmem
from hicache_jax.models.kernels.gated_delta_rule import decode_kernel as gdn_decode
from hicache_jax.models.kernels.gated_delta_rule import kernel as gdn
from hicache_jax.models.kernels.mamba2_ssd import decode_kernel as ssd_decode
from hicache_jax.models.kernels.mamba2_ssd import kernel as ssd

F32 = jnp.float32
NUM_SCALARS = 5  # write (working) slot, init, read slot, q_len, trail [S * Q]


class _Token:
    """A block holding Q tokens (on axis ``axis``) seen as the one-token block the decode
    step reads and writes: token ``j``'s index inserted at ``axis``."""

    def __init__(self, ref, axis: int, j: int):
        self.ref, self.axis, self.j = ref, axis, j
        self.shape = ref.shape[:axis] + ref.shape[axis + 1 :]

    def _at(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = () if idx == (Ellipsis,) else idx
        return idx[: self.axis] + (self.j,) + idx[self.axis :]

    def __getitem__(self, idx):
        return self.ref[self._at(idx)]

    def __setitem__(self, idx, value):
        self.ref[self._at(idx)] = value


def _trail_kernel(
    # scalar prefetch (SMEM)
    slots_ref,  # [S] working slot to write (-1: none, or padding)
    init_ref,  # [S] 1: start from the slot's state
    read_ref,  # [S] slot whose block the pipeline fetches
    qlen_ref,  # [S] tokens (0: padding)
    trail_ref,  # [S * Q] trail slot of token j of sequence s at s * Q + j (-1: none)
    # blocks (token axes per ``axes``), state_ref [HB, *state]; out_ref [Q, 1, HB*D];
    # states_out HBM aliasing the pool; out_scr [Q, HB, *state] f32; sems [Q + 1] DMA
    *refs,
    step: Callable,
    axes: tuple,  # per block: its token axis, or None (per-head operands)
):
    *blocks, state_ref, out_ref, states_out, out_scr, sems = refs
    hb, s = pl.program_id(0), pl.program_id(1)
    Q = out_scr.shape[0]
    HB = state_ref.shape[0]
    heads = pl.ds(hb * HB, HB)
    n = qlen_ref[s]
    slot = slots_ref[s]

    def copy(j, dst, sem):
        return pltpu.make_async_copy(out_scr.at[j], states_out.at[dst, heads], sems.at[sem])

    for j in range(Q):

        @pl.when(j < n)
        def _(j=j):
            views = tuple(b if a is None else _Token(b, a, j) for b, a in zip(blocks, axes, strict=True))
            prev = state_ref if j == 0 else _Token(out_scr, 0, j - 1)
            fresh = (init_ref[s] == 0) if j == 0 else False

            def put_state(h: int, new: jax.Array) -> None:
                out_scr[j, h] = new

            step(views, prev, fresh, _Token(out_ref, 0, j), put_state)
            t = trail_ref[s * Q + j]
            pl.when(t >= 0)(lambda: copy(j, t, j).start())
            pl.when((j == n - 1) & (slot >= 0))(lambda: copy(j, slot, Q).start())

    # A fresh sequence with no tokens leaves its slot at zeros, as the ordinary path does.
    fresh_empty = (n == 0) & (slot >= 0) & (init_ref[s] == 0)

    @pl.when(fresh_empty)
    def _():
        out_scr[0] = jnp.zeros(out_scr.shape[1:], F32)
        copy(0, slot, Q).start()

    for j in range(Q):  # the waits need only the byte count and the semaphore
        pl.when((j < n) & (trail_ref[s * Q + j] >= 0))(lambda j=j: copy(j, 0, j).wait())
    pl.when(((n > 0) | fresh_empty) & (slot >= 0))(lambda: copy(0, 0, Q).wait())


def _call(
    step: Callable,
    blocks: list,  # (operand, block spec, token axis or None)
    out_dim: int,
    states: jax.Array,
    tab: slot_update.Tables,
    scalars: tuple,  # q_lens [S], trail [S * Q]
    *,
    Q: int,
    head_block: int,
    num_rows: int,
    cost: pl.CostEstimate,
    interpret,
) -> tuple[jax.Array, jax.Array]:
    HB, T = head_block, num_rows
    S, H = tab.rows.shape[0], states.shape[1]
    state = states.shape[2:]
    zeros = (0,) * len(state)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=NUM_SCALARS,
        grid=(H // HB, S),
        in_specs=[
            *(spec for _, spec, _ in blocks),
            pl.BlockSpec((None, HB, *state), lambda hb, s, wr, init, rd, *_: (rd[s], hb, *zeros)),
        ],
        out_specs=[
            pl.BlockSpec((None, Q, 1, HB * out_dim), lambda hb, s, *_: (s, 0, 0, hb)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        scratch_shapes=[pltpu.VMEM((Q, HB, *state), F32), pltpu.SemaphoreType.DMA((Q + 1,))],
    )
    out_seq, states = pl.pallas_call(
        functools.partial(_trail_kernel, step=step, axes=tuple(a for _, _, a in blocks)),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((S, Q, 1, H * out_dim), F32),
            jax.ShapeDtypeStruct(states.shape, states.dtype),
        ],
        input_output_aliases={NUM_SCALARS + len(blocks): 1},
        compiler_params=vmem.compiler_params(("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(*tab.scalars, *scalars, *(a for a, _, _ in blocks), vmem.in_hbm(states, interpret))
    q_lens = scalars[0]
    rows = tab.rows[:, None] + jnp.arange(Q)[None, :]  # [S, Q]
    dest = jnp.where(jnp.arange(Q)[None, :] < q_lens[:, None], rows, T).reshape(S * Q)
    out = jnp.zeros((T, H, out_dim), F32).at[dest].set(out_seq.reshape(S * Q, H, out_dim), mode="drop")
    return out, states


def _tables(cu_seqlens, num_seqs, slots_trail, has_initial_state, num_rows: int):
    """The working slots' tables, each sequence's token rows [S, Q], q_lens and trail."""
    slots, trail = slots_trail[:, 0], slots_trail[:, 1:]
    S, Q = trail.shape
    tab = slot_update.tables(cu_seqlens, num_seqs, slots, has_initial_state, num_rows=num_rows)
    live = jnp.arange(S) < num_seqs
    q_lens = jnp.where(live, cu_seqlens[1:] - cu_seqlens[:-1], 0).astype(jnp.int32)
    named = (jnp.arange(Q)[None, :] < q_lens[:, None]) & (trail >= 0)
    trail = jnp.where(named, trail, -1).astype(jnp.int32).reshape(S * Q)
    rows = jnp.clip(tab.rows[:, None] + jnp.arange(Q)[None, :], 0, num_rows - 1)  # [S, Q]
    return tab, rows, (q_lens, trail)


def _trail_head_block(valid: list[int], need: Callable[[int], int], first: int) -> int:
    """The largest valid head block <= ``first`` (the decode kernel's) whose decode VMEM
    plus Q more states fits the tile budget; else the smallest valid one."""
    budget = vmem.tile_budget()
    fits = [hb for hb in valid if hb <= first and need(hb) <= budget]
    return fits[0] if fits else valid[-1]


def _per_head(a: jax.Array, rows: jax.Array, head_block: int) -> jax.Array:
    """[T, H] -> [S, H/HB, Q, 1, HB]: each sequence's token rows, a head block per tile."""
    S, Q = rows.shape
    H = a.shape[1]
    return a.astype(F32)[rows].reshape(S, Q, H // head_block, 1, head_block).transpose(0, 2, 1, 3, 4)


def _cost(per_token: pl.CostEstimate, S: int, Q: int, state_bytes: int) -> pl.CostEstimate:
    """The decode kernel's cost over S * Q tokens (``per_token``), its state traffic (each
    token's state read and written) replaced by the trail's: each sequence's state read
    once and written at most Q + 1 times (its trail, its working slot)."""
    io = per_token.bytes_accessed - 2 * S * Q * state_bytes
    return pl.CostEstimate(
        flops=per_token.flops,
        transcendentals=per_token.transcendentals,
        bytes_accessed=io + (Q + 2) * S * state_bytes,
    )


def _spec(block: tuple, index: Callable) -> pl.BlockSpec:
    return pl.BlockSpec(block, lambda hb, s, *_: index(hb, s))


@functools.partial(jax.jit, static_argnames=("head_block", "precision", "interpret"))
def ssd_trail(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    D: jax.Array,  # [H]
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    states: jax.Array,  # [num_slots, H, P, N] float32
    slots_trail: jax.Array,  # [S, 1 + Q] int32: working slot, then the trail (-1: none)
    has_initial_state: jax.Array,  # [S] bool
    *,
    head_block: int | None = None,
    precision=ssd.HIGHEST,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # y [T, H, P] float32, updated states
    """Mamba2's verify chunk, each state read once (``ssd_decode``'s step per token)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    ssd._check(states)
    tab, rows, scalars = _tables(cu_seqlens, num_seqs, slots_trail, has_initial_state, T)
    S, Q = rows.shape

    def need(hb: int) -> int:  # the decode kernel's VMEM, and a state per token
        gb = max(1, hb // (H // G))
        return ssd.decode_vmem_bytes(hb, gb, P, N, x.dtype) + Q * ssd._tiled_bytes((hb, P, N), F32)

    first = ssd.pick_head_block(H, G, P, N, x.dtype)
    HB = head_block or _trail_head_block(ssd.head_blocks(H, G, P), need, first)
    GB, hpg = ssd._group_block(H, G, HB)
    gblk = functools.partial(ssd._group_blk, head_block=HB, hpg=hpg, groups_per_block=GB)
    per_group = lambda v: v[rows].transpose(0, 2, 1, 3)[:, :, :, None]  # [S, G, Q, 1, N]
    group_spec = _spec((None, GB, Q, 1, N), lambda hb, s: (s, gblk(hb), 0, 0, 0))
    head_spec = _spec((None, 1, HB), lambda hb, s: (hb, 0, 0))
    blocks = [  # (operand, block spec, token axis), in _step's order
        (x[rows].reshape(S, Q, 1, H * P), _spec((None, Q, 1, HB * P), lambda hb, s: (s, 0, 0, hb)), 0),
        (_per_head(dt, rows, HB), _spec((None, None, Q, 1, HB), lambda hb, s: (s, hb, 0, 0, 0)), 0),
        (ssd._head_major(A.astype(F32)[None], HB), head_spec, None),
        (per_group(B), group_spec, 1),
        (per_group(C), group_spec, 1),
        (ssd._head_major(D.astype(F32)[None], HB), head_spec, None),
    ]
    step = functools.partial(ssd_decode._step, hpg=hpg, precision=precision)
    cost = _cost(ssd.decode_cost(S * Q, H, P, N, G, HB, x.dtype), S, Q, H * P * N * 4)
    return _call(
        step, blocks, P, states, tab, scalars, Q=Q, head_block=HB, num_rows=T, cost=cost, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("head_block", "precision", "interpret"))
def gdn_trail(
    q: jax.Array,  # [T, H, Dk] l2-normalised, scaled by Dk ** -0.5
    k: jax.Array,  # [T, H, Dk] l2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H] log-decay, <= 0
    beta: jax.Array,  # [T, H]
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    states: jax.Array,  # [num_slots, H, Dk, Dv] float32
    slots_trail: jax.Array,  # [S, 1 + Q] int32: working slot, then the trail (-1: none)
    has_initial_state: jax.Array,  # [S] bool
    *,
    head_block: int | None = None,
    precision=ssd.HIGHEST,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # o [T, H, Dv] float32, updated states
    """Gated DeltaNet's verify chunk, each state read once (``gdn_decode``'s step per token)."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    tab, rows, scalars = _tables(cu_seqlens, num_seqs, slots_trail, has_initial_state, T)
    S, Q = rows.shape

    def need(hb: int) -> int:  # the decode kernel's VMEM, and a state per token
        return gdn.decode_vmem_bytes(hb, Dk, Dv, q.dtype) + Q * ssd._tiled_bytes((hb, Dk, Dv), F32)

    first = gdn.pick_head_block(H, Dk, Dv, q.dtype)
    HB = head_block or _trail_head_block(gdn.head_blocks(H, Dk, Dv), need, first)
    gdn._check(states, HB, H)
    cols = lambda d: _spec((None, Q, 1, HB * d), lambda hb, s: (s, 0, 0, hb))
    head_spec = _spec((None, None, Q, 1, HB), lambda hb, s: (s, hb, 0, 0, 0))
    blocks = [  # (operand, block spec, token axis), in _step's order
        (q[rows].reshape(S, Q, 1, H * Dk), cols(Dk), 0),
        (k[rows].reshape(S, Q, 1, H * Dk), cols(Dk), 0),
        (v[rows].reshape(S, Q, 1, H * Dv), cols(Dv), 0),
        (_per_head(g, rows, HB), head_spec, 0),
        (_per_head(beta, rows, HB), head_spec, 0),
    ]
    step = functools.partial(gdn_decode._step, precision=precision)
    cost = _cost(gdn.decode_cost(S * Q, H, Dk, Dv, q.dtype), S, Q, H * Dk * Dv * 4)
    return _call(
        step, blocks, Dv, states, tab, scalars, Q=Q, head_block=HB, num_rows=T, cost=cost, interpret=interpret
    )
