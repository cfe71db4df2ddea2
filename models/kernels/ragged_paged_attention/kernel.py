"""Ragged paged attention as a Pallas TPU kernel (the KV page write is in ``kv_write.py``).

Same interface and semantics as ``reference.py``; runs on TPU (Mosaic) and, with
``interpret=True`` (or ``pltpu.InterpretParams()``), on CPU.

Grid: one step per query block of ``q_block`` rows that never crosses a sequence boundary
(the layout of ``reference.py``: ``cdiv(T, q_block) + S`` steps, the tail idle). Each step
walks only the KV pages its rows can see, ``kv_block_pages`` pages per inner-loop step,
copying them from HBM into a double-buffered VMEM scratch (block ``c + 1`` is in flight
while block ``c`` is computed)::

    positions  0 ........ lo .................... pos0 ...... hi-1 ..... kv_len-1
                          |<-- window of row 0 -->|                 |
    pages      [  skipped  ][ loaded: p_lo .. p_hi-1, kbp per step ][ skipped ]
                            lo = max(0, pos0 - window + 1), hi = pos0 + rows (causal)

Pages before ``p_lo`` and from ``p_hi`` on are neither copied nor computed, and their
page-table entries are never read, so they may hold NaN or garbage page ids. Inside the
loaded pages, keys outside ``[lo, hi)`` are masked, and their values zeroed, because a
page that straddles the window edge or ``kv_len`` may hold NaN in those slots.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = float("-inf")


def _query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens: int, q_block: int):
    """Cut the ragged queries into blocks of ``q_block`` rows, one sequence each.

    Returns per block (all ``[NB]`` int32): its sequence, its first row in ``q``, how many
    of its rows are real (0 for the idle tail) and the KV position of its first row.
    """
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    q_lens = jnp.where(jnp.arange(S) < num_seqs, q_lens, 0)
    nblk = (q_lens + q_block - 1) // q_block  # [S]
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    # sum(ceil(q_len / q_block)) <= floor(T / q_block) + S: this many steps always suffice.
    NB = num_tokens if q_block == 1 else pl.cdiv(num_tokens, q_block) + S
    b = jnp.arange(NB)
    seq = jnp.minimum(jnp.searchsorted(blk_end, b, side="right"), S - 1).astype(jnp.int32)
    first = (b - blk_start[seq]) * q_block  # first row of the block within its sequence
    rows = jnp.where(b < blk_end[-1], jnp.clip(q_lens[seq] - first, 0, q_block), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + first
    start = cu_q_lens[seq] + first
    return seq, start.astype(jnp.int32), rows.astype(jnp.int32), pos0.astype(jnp.int32)


def _head_tiles(buf, C: int):
    """Yield each KV head's ``[C, D]`` tile of a ``[C * Hkv, D]`` buffer (rows token-major).

    Heads are interleaved in a page, so head h's rows are every Hkv-th row: a strided load.
    Mosaic packs two bf16 rows into each 32-bit sublane, so a row stride over bf16 would pick
    half-words; instead one 32-bit strided load fetches the head pair (2m, 2m + 1), row 2m in
    the low half, and a bf16 moved to the high half of a 32-bit word is that value as f32.
    """
    Hkv = buf.shape[0] // C
    if Hkv == 1:
        yield buf[pl.ds(0, C), :]
    elif buf.dtype == jnp.bfloat16 and Hkv % 2 == 0:
        words = buf.bitcast(jnp.uint32)  # [C * Hkv / 2, D]
        for pair in range(Hkv // 2):
            w = words[pl.ds(pair, C, stride=Hkv // 2), :]  # [C, D] u32
            yield pltpu.bitcast(w << 16, jnp.float32).astype(buf.dtype)
            yield pltpu.bitcast(w & jnp.uint32(0xFFFF0000), jnp.float32).astype(buf.dtype)
    else:
        for h in range(Hkv):
            yield buf[pl.ds(h, C, stride=Hkv), :]


def _attention_kernel(
    # Scalar prefetch (SMEM).
    page_tables_ref,  # [S * max_pages] int32, flattened
    blk_seq_ref,  # [NB] int32
    blk_rows_ref,  # [NB] int32, real rows in the block; 0: idle
    blk_pos_ref,  # [NB] int32, KV position of the block's first row
    # Inputs.
    q_ref,  # [1, Hkv, R, D] VMEM, R = q_block * G rows ordered (row, group)
    k_hbm,  # [num_pages, page_size * Hkv, D] ANY
    v_hbm,  # [num_pages, page_size * Hkv, D] ANY
    # Output.
    o_ref,  # [1, Hkv, R, D] VMEM
    # Scratch.
    k_buf,  # [2, kbp * page_size * Hkv, D] VMEM, double buffer
    v_buf,  # [2, kbp * page_size * Hkv, D] VMEM
    sems,  # [2] DMA semaphores, one per buffer slot
    m_ref,  # [Hkv, R, 1] f32 running max
    l_ref,  # [Hkv, R, 1] f32 running denominator
    acc_ref,  # [Hkv, R, D] f32 running numerator
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    page_size: int,
    kbp: int,
    max_pages: int,
    group: int,
):
    _, Hkv, R, D = q_ref.shape
    C = kbp * page_size  # KV tokens per inner step
    page_rows = page_size * Hkv  # rows of one page in the flattened [tokens * Hkv, D] view
    b = pl.program_id(0)
    n_rows = blk_rows_ref[b]

    @pl.when(n_rows == 0)
    def _idle():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(n_rows > 0)
    def _attend():
        seq = blk_seq_ref[b]
        pos0 = blk_pos_ref[b]
        hi = pos0 + n_rows  # one past the last key any row of the block may see
        lo = jnp.maximum(pos0 - sliding_window + 1, 0) if sliding_window else jnp.int32(0)
        p_lo = lo // page_size
        p_hi = (hi + page_size - 1) // page_size
        n_kv_blocks = (p_hi - p_lo + kbp - 1) // kbp

        def page_copies(kv_blk, slot, j):
            """Descriptors of page ``j`` of KV block ``kv_blk``; read only when it is needed."""
            page = page_tables_ref[seq * max_pages + p_lo + kv_blk * kbp + j]
            dst = pl.ds(j * page_rows, page_rows)
            return (
                pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, dst], sems.at[slot]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, dst], sems.at[slot]),
            )

        def for_needed_pages(kv_blk, slot, action):
            # A KV block's tail pages from p_hi on are skipped (their buffer rows stay stale
            # and are masked below); starts and waits walk the same pages.
            first = p_lo + kv_blk * kbp
            n = jnp.minimum(kbp, p_hi - first)

            def each(j, carry):
                for copy in page_copies(kv_blk, slot, j):
                    action(copy)
                return carry

            lax.fori_loop(0, n, each, 0)

        for_needed_pages(0, 0, lambda c: c.start())
        m_ref[...] = jnp.full_like(m_ref, NEG_INF)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

        # Row r of a head's [R, D] query tile is query row i = r // G of the block, at
        # position pos0 + i. With d = k_pos - pos0 the masks compare d * G with r, which
        # avoids a vector division: i >= d <=> r >= d * G, and i < d <=> r < d * G.
        r = lax.broadcasted_iota(jnp.int32, (R, C), 0)  # [R, C]
        col = lax.broadcasted_iota(jnp.int32, (R, C), 1)  # [R, C]
        col_v = lax.broadcasted_iota(jnp.int32, (C, 1), 0)  # [C, 1]

        def kv_step(kv_blk, carry):
            slot = kv_blk % 2

            @pl.when(kv_blk + 1 < n_kv_blocks)
            def _prefetch_next():
                for_needed_pages(kv_blk + 1, 1 - slot, lambda c: c.start())

            for_needed_pages(kv_blk, slot, lambda c: c.wait())

            base = (p_lo + kv_blk * kbp) * page_size  # KV position of column 0
            d = base - pos0 + col  # [R, C] key position relative to the block's first row
            mask = (r < n_rows * group) & (d * group <= r)  # a real row, causal
            if sliding_window:
                mask &= r < (d + sliding_window) * group  # key > q_pos - window
            # Values outside [lo, hi) may be NaN (or stale buffer rows): zero them, since
            # 0 * NaN would survive a zero probability.
            v_pos = base + col_v  # [C, 1]
            v_ok = (v_pos >= lo) & (v_pos < hi)  # [C, 1]

            heads = zip(_head_tiles(k_buf.at[slot], C), _head_tiles(v_buf.at[slot], C), strict=True)
            for h, (k, v) in enumerate(heads):  # k, v: [C, D]
                v = jnp.where(v_ok, v, jnp.zeros_like(v))
                q = q_ref[0, h]  # [R, D]
                precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
                s = lax.dot_general(
                    q,
                    k,
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )  # [R, C]
                s = s * sm_scale
                if soft_cap:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, NEG_INF)

                m_prev = m_ref[h]  # [R, 1]
                m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with no key yet
                p = jnp.exp(s - m_safe)  # [R, C]
                alpha = jnp.exp(m_prev - m_safe)  # [R, 1]
                l_ref[h] = alpha * l_ref[h] + p.sum(axis=-1, keepdims=True)
                pv = lax.dot_general(
                    p.astype(v.dtype),
                    v,
                    (((1,), (0,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )  # [R, D]
                acc_ref[h] = alpha * acc_ref[h] + pv
                m_ref[h] = m_new
            return carry

        lax.fori_loop(0, n_kv_blocks, kv_step, 0)
        l = l_ref[...]
        out = acc_ref[...] / jnp.where(l == 0.0, 1.0, l)  # [Hkv, R, D]; rows with no key: 0
        o_ref[0] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "q_block",
        "kv_block_pages",
        "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    kv_lens: jax.Array,  # [S] int32
    page_tables: jax.Array,  # [S, max_pages] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    q_block: int = 8,
    kv_block_pages: int | None = None,
    interpret: Any = False,
) -> jax.Array:  # [T, Hq, D]
    T, Hq, D = q.shape
    num_pages, page_size, Hkv, _ = k_pages.shape
    S, max_pages = page_tables.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not group over {Hkv} KV heads")
    G = Hq // Hkv
    Bq = q_block
    R = Bq * G
    kbp = min(kv_block_pages or max(1, 128 // page_size), max_pages)

    seq, start, rows, pos0 = _query_blocks(cu_q_lens, kv_lens, num_seqs, T, Bq)
    NB = seq.shape[0]
    i = jnp.arange(Bq)
    q_rows = jnp.where(i[None, :] < rows[:, None], start[:, None] + i[None, :], T)  # [NB, Bq]
    # Gather each block's rows and put a KV head's G query heads under it: [NB, Hkv, R, D].
    qb = q.at[jnp.minimum(q_rows, T - 1)].get().reshape(NB, Bq, Hkv, G, D)
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, R, D)

    # Free reshapes: a page becomes [page_size * Hkv, D] rows for one contiguous DMA.
    k_flat = k_pages.reshape(num_pages, page_size * Hkv, D)
    v_flat = v_pages.reshape(num_pages, page_size * Hkv, D)

    kernel = functools.partial(
        _attention_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        page_size=page_size,
        kbp=kbp,
        max_pages=max_pages,
        group=G,
    )
    block = pl.BlockSpec((1, Hkv, R, D), lambda b, *_: (b, 0, 0, 0))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(NB,),
            in_specs=[block, any_space, any_space],
            out_specs=block,
            scratch_shapes=[
                pltpu.VMEM((2, kbp * page_size * Hkv, D), k_pages.dtype),
                pltpu.VMEM((2, kbp * page_size * Hkv, D), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, D), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((NB, Hkv, R, D), q.dtype),
        # Every step starts and drains its own copies, so steps may run in any order.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(page_tables.reshape(-1).astype(jnp.int32), seq, rows, pos0, qb, k_flat, v_flat)

    out = out.reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    return jnp.zeros((T, Hq, D), q.dtype).at[q_rows.reshape(-1)].set(out, mode="drop")
