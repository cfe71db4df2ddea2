"""The one-token state update both decode kernels run (Mamba2 SSD ``ssd_decode``, Gated
DeltaNet ``gdn_decode``); they differ only in their blocks and in the step per head. Decode
is bound by the state pool's bytes, so each state is read once and written once::

    grid (head block, sequence s):
      read   states[read[s], heads] by a BlockSpec that follows the slot table, so Pallas
             prefetches sequence s+1's state while s computes
      step   the new state into out_scr[s % 2], the output row into out_ref
      write  out_scr[s % 2] -> states[slots[s], heads] by an async DMA, waited for two
             sequences later (before out_scr[s % 2] is reused) or at the last sequence

A sequence that reads nothing (fresh, no slot or padding) re-uses the previous read's block
index, so the pipeline issues no DMA for it, and its step starts from zeros instead.

Every load and store in the kernel is static: the caller gathers each sequence's one token
row into per-sequence operands (``Tables.rows``) whose block for sequence ``s`` is a whole
dimension, and ``slot_update`` scatters the output back to the token rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import vmem

F32 = jnp.float32
NUM_SCALARS = 3  # scalar-prefetch operands (``Tables.scalars``)

# step(blocks, state_ref, fresh, out_ref, put_state): one sequence's update of its head
# block, from the state in ``state_ref`` [HB, *state] (zeros where ``fresh``); head h's new
# state goes out by ``put_state(h, new)``, the output row to ``out_ref``.
Step = Callable[..., None]


class Tables(NamedTuple):
    rows: jax.Array  # [S] each sequence's token row
    live: jax.Array  # [S] the sequence is one of the first num_seqs
    scalars: tuple[jax.Array, ...]  # [S] each: write slot (-1: none), init (1: read), read slot


def tables(
    cu_seqlens: jax.Array,  # [S + 1]; sequence s's one token is row cu_seqlens[s]
    num_seqs: jax.Array,  # []
    slots: jax.Array,  # [S] int32, -1: none
    has_initial_state: jax.Array,  # [S] bool
    *,
    num_rows: int,
) -> Tables:
    """Each sequence's token row and the kernel's slot tables, for ``num_rows`` token rows."""
    S = slots.shape[0]
    s_idx = jnp.arange(S, dtype=jnp.int32)
    live = s_idx < num_seqs
    rows = jnp.clip(cu_seqlens[:-1], 0, num_rows - 1).astype(jnp.int32)  # [S]
    write = jnp.where(live, slots, -1).astype(jnp.int32)  # [S]
    init = (live & (slots >= 0) & has_initial_state).astype(jnp.int32)  # [S]
    reader = lax.cummax(jnp.where(init > 0, s_idx, -1), axis=0)  # [S] last reader so far
    read = jnp.where(reader >= 0, write[jnp.maximum(reader, 0)], 0)  # [S]
    return Tables(rows, live, (write, init, read.astype(jnp.int32)))


def _decode_kernel(
    # scalar prefetch (SMEM)
    slots_ref,  # [S] slot to write (-1: none, or padding)
    init_ref,  # [S] 1: start from the slot's state
    read_ref,  # [S] slot whose block the pipeline fetches
    # sequence s's blocks (its token, this head block's part of it), then:
    # state_ref [HB, *state], states[read[s], head block], double-buffered by Pallas;
    # out_ref [1, HB*D]; states_out [num_slots, H, *state] HBM, aliasing the state pool;
    # out_scr [2, HB, *state] f32, new states written back while the next sequence runs;
    # sems [2] DMA semaphores; pending [2] int32 SMEM, a write-back from out_scr[i] is in flight
    *refs,
    step: Step,
):
    *blocks, state_ref, out_ref, states_out, out_scr, sems, pending = refs
    hb, s = pl.program_id(0), pl.program_id(1)
    S = pl.num_programs(1)
    HB = state_ref.shape[0]
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

    def put_state(h: int, new: jax.Array) -> None:
        out_scr[buf, h] = new

    step(tuple(blocks), state_ref, fresh, out_ref, put_state)

    @pl.when(slot >= 0)
    def _():
        copy(buf, slot).start()
        pending[buf] = 1

    @pl.when(s == S - 1)  # leave nothing in flight when the head block ends
    def _():
        drain(0)
        drain(1)


def slot_update(
    step: Step,
    tables: Tables,
    blocks: Sequence[tuple[jax.Array, pl.BlockSpec]],  # [S, ...] per-sequence operands
    out_spec: pl.BlockSpec,  # [1, HB*out_dim] block of [S, 1, H*out_dim], at (s, 0, hb)
    states: jax.Array,  # [num_slots, H, *state] float32
    *,
    num_rows: int,
    head_block: int,
    out_dim: int,
    cost: pl.CostEstimate,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # out [num_rows, H, out_dim] float32, updated states
    """Run the update over (head block, sequence) with ``step`` per sequence, and scatter
    the output to the token rows (rows of padding sequences left 0). Index maps of
    ``blocks`` take ``(hb, s, *tables.scalars)``."""
    HB, T = head_block, num_rows
    S, H = tables.rows.shape[0], states.shape[1]
    state = states.shape[2:]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=NUM_SCALARS,
        grid=(H // HB, S),
        in_specs=[
            *(spec for _, spec in blocks),
            pl.BlockSpec((None, HB, *state), lambda hb, s, wr, init, rd: (rd[s], hb, 0, 0)),
        ],
        out_specs=[out_spec, pl.BlockSpec(memory_space=pl.ANY)],  # out, states
        scratch_shapes=[
            pltpu.VMEM((2, HB, *state), F32),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((2,), jnp.int32),
        ],
    )
    out_seq, states = pl.pallas_call(
        functools.partial(_decode_kernel, step=step),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((S, 1, H * out_dim), F32),
            jax.ShapeDtypeStruct(states.shape, states.dtype),
        ],
        input_output_aliases={NUM_SCALARS + len(blocks): 1},  # the states operand
        compiler_params=vmem.compiler_params(("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(*tables.scalars, *(a for a, _ in blocks), vmem.in_hbm(states, interpret))
    dest = jnp.where(tables.live, tables.rows, T)  # padding sequences write no row
    out = jnp.zeros((T, H, out_dim), F32).at[dest].set(out_seq.reshape(S, H, out_dim), mode="drop")
    return out, states
