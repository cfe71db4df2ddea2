"""The segment walk both ragged chunked-scan kernels run (Mamba2 SSD ``ssd_ragged``, Gated
DeltaNet ``gdn_ragged``); they differ only in their blocks and in the chunk of the scan done
per segment. Each reads a sequence's initial state from its slot in the state pool and writes
the final state back to that slot inside the kernel; the pool is aliased input -> output, so
under a jit that donates it the update is in place.

Grid = (head block, token block). A token block is ``chunk`` rows of the flat batch, so it may
cut through sequences; each grid step loops over its *segments* (sequence ∩ block)::

    rows (cu)     0                               40   43                 63 64
    sequences     |<--------- s0: 40 ------------>|s1:3|<------ s2: 20 ----->|
    token blocks  | b0: 0-16  | b1: 16-32 | b2: 32-48         | b3: 48-64      |
    segments      | s0        | s0        | s0:8 | s1:3 | s2:5 | s2:15 | pad:1  |

The state of the sequence that runs across a block boundary is carried to the next block in
VMEM scratch (the token-block axis runs in order). A sequence's first segment loads its state
from ``states[slots[s]]`` (or zeros), its last segment writes the state back. Token-block
major keeps the row blocks aligned, so Pallas double-buffers them; a sequence-major grid
would need ragged row DMAs whose last chunk spills into the next sequence's rows. The work is
the same bound either way: segments <= num_blocks + num_seqs, each one chunk of work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import vmem

F32 = jnp.float32
NUM_SCALARS = 6  # scalar-prefetch operands (``prefetch_scalars``)

# segment(lo, hi, blocks, out_ref, h_scr): one chunk of the scan for the rows [lo, hi) of
# this token block, adding to ``out_ref`` and updating the running state in ``h_scr``.
Segment = Callable[..., None]


def pad_rows(chunk: int, *arrays: jax.Array) -> list[jax.Array]:
    """``arrays`` ([T, ...]) with zero rows appended up to whole token blocks. Rows past
    cu_seqlens[num_seqs] are never live, so zero padding is safe."""
    T = arrays[0].shape[0]
    Tp = -(-T // chunk) * chunk
    if Tp == T:
        return list(arrays)
    return [jnp.pad(v, [(0, Tp - T)] + [(0, 0)] * (v.ndim - 1)) for v in arrays]


def live_cu(cu_seqlens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """cu_seqlens with entries past num_seqs pinned to the live end (padding may hold junk)."""
    n = cu_seqlens.shape[0]
    cu = cu_seqlens.astype(jnp.int32)
    return jnp.where(jnp.arange(n) <= num_seqs, cu, cu[num_seqs])


def prefetch_scalars(
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    slots: jax.Array,  # [S] int32, -1: none
    has_initial_state: jax.Array,  # [S] bool
    *,
    num_rows: int,
    chunk: int,
) -> tuple[jax.Array, ...]:
    """The walk's scalar-prefetch operands, in ``_ragged_kernel``'s order, for ``num_rows``
    (padded, whole token blocks) rows."""
    Q = chunk
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    cu = live_cu(cu_seqlens, num_seqs)  # [S + 1]
    blk_lo = jnp.arange(num_rows // Q, dtype=jnp.int32) * Q
    # Sequences touching block b: those ending after its start and starting before its end.
    first = jnp.searchsorted(cu[1:], blk_lo, side="right").astype(jnp.int32)  # [NB]
    last = jnp.minimum(jnp.searchsorted(cu[:-1], blk_lo + Q, side="left"), num_seqs)  # [NB]
    last_blk = jnp.maximum((cu[num_seqs] + Q - 1) // Q - 1, 0)
    meta = jnp.stack([num_seqs, last_blk]).astype(jnp.int32)  # [2]
    init = has_initial_state.astype(jnp.int32)
    return cu, meta, slots.astype(jnp.int32), init, first, last.astype(jnp.int32)


def row_block(b, meta_ref):
    """The row block to fetch at token block ``b``, for an index map ``(hb, b, *scalars)``:
    blocks past the live rows re-use the last live block index, so Pallas skips their DMA."""
    return jnp.minimum(b, meta_ref[1])


def _ragged_kernel(
    # scalar prefetch (SMEM)
    cu_ref,  # [S + 1] live cu_seqlens
    meta_ref,  # [2]: num_seqs, last token block holding live rows
    slots_ref,  # [S] state slot (-1: none)
    init_ref,  # [S] 1: start from the slot's state
    first_ref,  # [NB] first sequence touching each token block
    last_ref,  # [NB] one past the last sequence touching it
    # the kernel's row and head blocks (VMEM), then the state pool (HBM), then:
    # states_in [num_slots, H, *state] HBM; out_ref [Q, HB*D]; states_out, aliasing
    # states_in; h_scr [HB, *state] f32, the running state; sem, a DMA semaphore
    *refs,
    segment: Segment,
):
    *blocks, states_in, out_ref, states_out, h_scr, sem = refs
    hb, blk = pl.program_id(0), pl.program_id(1)
    Q = out_ref.shape[0]
    HB = h_scr.shape[0]
    heads = pl.ds(hb * HB, HB)
    num_seqs = meta_ref[0]

    def write_state(slot):
        copy = pltpu.make_async_copy(h_scr, states_out.at[slot, heads], sem)
        copy.start()
        copy.wait()  # h_scr is reused by the next segment

    @pl.when(blk == 0)
    def _():
        # Empty live sequences touch no block: their final state is their initial state,
        # which for a fresh one means writing zeros (as the xla backend does).
        h_scr[...] = jnp.zeros(h_scr.shape, F32)

        def empty(s, carry):
            fresh = (cu_ref[s + 1] == cu_ref[s]) & (slots_ref[s] >= 0) & (init_ref[s] == 0)
            pl.when(fresh)(lambda: write_state(slots_ref[s]))
            return carry

        lax.fori_loop(0, num_seqs, empty, 0)

    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)
    blk_lo = blk * Q

    def walk(s, carry):
        start, end, slot = cu_ref[s], cu_ref[s + 1], slots_ref[s]
        live = slot >= 0

        @pl.when(end > start)
        def _():
            @pl.when(start >= blk_lo)  # the sequence begins here: load its initial state
            def _():
                @pl.when(live & (init_ref[s] != 0))
                def _():
                    copy = pltpu.make_async_copy(states_in.at[slot, heads], h_scr, sem)
                    copy.start()
                    copy.wait()

                @pl.when(~(live & (init_ref[s] != 0)))
                def _():
                    h_scr[...] = jnp.zeros(h_scr.shape, F32)

            lo = jnp.maximum(start - blk_lo, 0)
            hi = jnp.minimum(end - blk_lo, Q)
            segment(lo, hi, tuple(blocks), out_ref, h_scr)
            pl.when(live & (end <= blk_lo + Q))(lambda: write_state(slot))  # it ends here

        return carry

    lax.fori_loop(first_ref[blk], last_ref[blk], walk, 0)


def ragged_scan(
    segment: Segment,
    scalars: tuple[jax.Array, ...],  # from ``prefetch_scalars``
    blocks: Sequence[tuple[jax.Array, pl.BlockSpec]],  # [Tp, ...] or per-head operands
    states: jax.Array,  # [num_slots, H, *state] float32
    *,
    chunk: int,
    head_block: int,
    out_dim: int,
    cost: pl.CostEstimate,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # out [Tp, H*out_dim] float32, updated states
    """Run the walk over (head block, token block) with ``segment`` as the chunk of the scan.
    Index maps of ``blocks`` take ``(hb, b, *scalars)``; out is ``[Q, HB*out_dim]`` blocks."""
    Q, HB = chunk, head_block
    H = states.shape[1]
    NB = scalars[4].shape[0]  # first: [NB], one entry per token block
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=NUM_SCALARS,
        grid=(H // HB, NB),
        in_specs=[spec for _, spec in blocks] + [pl.BlockSpec(memory_space=pl.ANY)],  # + states
        out_specs=[
            pl.BlockSpec((Q, HB * out_dim), lambda hb, b, *_: (b, hb)),  # out
            pl.BlockSpec(memory_space=pl.ANY),  # states
        ],
        scratch_shapes=[pltpu.VMEM((HB, *states.shape[2:]), F32), pltpu.SemaphoreType.DMA],
    )
    return pl.pallas_call(
        functools.partial(_ragged_kernel, segment=segment),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((NB * Q, H * out_dim), F32),
            jax.ShapeDtypeStruct(states.shape, states.dtype),
        ],
        input_output_aliases={NUM_SCALARS + len(blocks): 1},  # the states operand
        compiler_params=vmem.compiler_params(("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(*scalars, *(a for a, _ in blocks), vmem.in_hbm(states, interpret))
