"""Ragged paged attention in plain JAX: the reference for the Pallas kernel and the ``xla``
backend that CPU serving runs.

Queries of a mixed batch (prefill chunks and decode tokens) are cut into blocks of
``q_block`` rows that never cross a sequence boundary; each block walks its sequence's KV
``kv_block_pages`` pages at a time with an online softmax, so the work grows with each
sequence's own length, not with the size of the page pool::

    sequence s:  kv positions  0 ........................ kv_len-1
                 new queries               q0 ........... kv_len-1   (q0 = kv_len - q_len)
    query at p sees keys  max(0, p - window + 1) .. p

Pages outside every query's window, and slots past ``kv_len``, are never mixed into the
result (they may hold NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def _block_layout(cu_q_lens, num_seqs, num_tokens: int, q_block: int):
    """Map query blocks to (sequence, first row in sequence)."""
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_lens = jnp.where(jnp.arange(S) < num_seqs, q_lens, 0)
    nblk = (q_lens + q_block - 1) // q_block
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    # Each sequence wastes at most one partial block.
    NB = num_tokens if q_block == 1 else -(-num_tokens // q_block) + S
    b = jnp.arange(NB)
    seq = jnp.minimum(jnp.searchsorted(blk_end, b, side="right"), S - 1)
    valid = b < blk_end[-1]
    first = (b - blk_start[seq]) * q_block
    return seq, first, valid, q_lens


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "q_block", "kv_block_pages")
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
) -> jax.Array:  # [T, Hq, D]
    T, Hq, D = q.shape
    _, page_size, Hkv, _ = k_pages.shape
    S, max_pages = page_tables.shape
    G = Hq // Hkv
    kbp = kv_block_pages or max(1, 128 // page_size)
    C = kbp * page_size  # KV tokens per step
    pad = -max_pages % kbp
    if pad:
        page_tables = jnp.pad(page_tables, ((0, 0), (0, pad)))

    seq, first, blk_valid, q_lens = _block_layout(cu_q_lens, num_seqs, T, q_block)
    i = jnp.arange(q_block)
    row_in_seq = first[:, None] + i[None, :]  # [NB, Bq]
    row_valid = blk_valid[:, None] & (row_in_seq < q_lens[seq][:, None])
    rows = jnp.where(row_valid, cu_q_lens[seq][:, None] + row_in_seq, T)  # T: dropped
    kv_len = kv_lens[seq]  # [NB]
    q_pos = (kv_len - q_lens[seq])[:, None] + row_in_seq  # [NB, Bq]
    NB = seq.shape[0]

    qb = q.at[jnp.minimum(rows, T - 1)].get().reshape(NB, q_block, Hkv, G, D)
    qb = qb.astype(jnp.float32) * sm_scale

    # Keys a block may need: from its first query's window start up to its kv_len.
    q_first = kv_len - q_lens[seq] + first
    lo_tok = jnp.maximum(q_first - sliding_window + 1, 0) if sliding_window else jnp.zeros_like(q_first)
    lo_tok = jnp.where(blk_valid, lo_tok, jnp.iinfo(jnp.int32).max)
    hi_tok = jnp.where(blk_valid, kv_len, 0)
    c_lo = jnp.min(lo_tok) // C
    c_hi = (jnp.max(hi_tok) + C - 1) // C

    block_tables = page_tables[seq]  # [NB, max_pages]

    def body(c, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(block_tables, c * kbp, kbp, axis=1)  # [NB, kbp]
        k = k_pages.at[pages].get(mode="clip").reshape(NB, C, Hkv, D).astype(jnp.float32)
        v = v_pages.at[pages].get(mode="clip").reshape(NB, C, Hkv, D).astype(jnp.float32)
        k_pos = c * C + jnp.arange(C)  # [C]
        kv_ok = (k_pos[None, :] < kv_len[:, None]) & (k_pos[None, :] >= lo_tok[:, None])  # [NB, C]
        v = jnp.where(kv_ok[:, :, None, None], v, 0.0)
        s = jnp.einsum("bqkgd,bckd->bkgqc", qb, k)
        if soft_cap:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = kv_ok[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])  # [NB, Bq, C]
        if sliding_window:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        s = jnp.where(mask[:, None, None], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("bkgqc,bckd->bkgqd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((NB, Hkv, G, q_block), NEG_INF, jnp.float32),
        jnp.zeros((NB, Hkv, G, q_block), jnp.float32),
        jnp.zeros((NB, Hkv, G, q_block, D), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(c_lo, c_hi, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # rows with no keys stay 0
    out = out.transpose(0, 3, 1, 2, 4).reshape(NB * q_block, Hq, D).astype(q.dtype)
    return jnp.zeros((T, Hq, D), q.dtype).at[rows.reshape(-1)].set(out, mode="drop")


def write_kv(
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,
    slot_mapping: jax.Array,  # [T] int32, page * page_size + offset; -1 writes nothing
) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens' K/V into their page slots."""
    shape = k_pages.shape
    n = shape[0] * shape[1]
    idx = jnp.where(slot_mapping < 0, n, slot_mapping)  # out of range: dropped

    def put(pages, x):
        flat = pages.reshape(n, *shape[2:])
        return flat.at[idx].set(x.astype(pages.dtype), mode="drop").reshape(shape)

    return put(k_pages, k), put(v_pages, v)
