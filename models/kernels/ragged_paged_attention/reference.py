"""Ragged paged attention in plain JAX: the reference for the Pallas kernel and the ``xla``
backend that CPU serving runs.

Queries of a mixed batch (prefill chunks and decode tokens) are cut into blocks of
``q_block`` rows that never cross a sequence boundary. Each block walks only the KV its own
rows can see, ``kv_block_pages`` pages at a time, with an online softmax; so the work
follows each block's own span, not the longest sequence of the batch or the page pool::

    sequence s:  kv positions  0 ........................ kv_len-1
                 new queries               q0 ........... kv_len-1   (q0 = kv_len - q_len)
    query at p sees keys  max(0, p - window + 1) .. p

    a block of rows at positions pos0 .. pos0+rows-1 sees keys lo .. hi-1,
        lo = max(0, pos0 - window + 1),  hi = pos0 + rows
    and walks its pages from lo // page_size on, kbp at a time, until it passes hi

Blocks run a few at a time (``kv_bytes_per_step``); the real blocks come first and steps
past them are skipped, so padding blocks cost at most the rest of one step. Pages outside
every query's window, and slots past ``kv_len``, are never mixed into the result (they may
hold NaN); page-table entries before a block's first page are never read.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from hicache_jax.models.kv_quant import store

NEG_INF = float("-inf")


def kv_bytes_per_step() -> int:
    """Blocks walk their KV together in steps whose gathered K and V chunks come to about
    this many bytes. On CPU about a cache's worth: the chunks stay in cache from the gather
    to the dots. Elsewhere one step for all blocks: fewer, larger kernels."""
    return 1 << 20 if jax.default_backend() == "cpu" else 1 << 40


def _query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens: int, q_block: int, window: int | None):
    """Cut the ragged queries into blocks of ``q_block`` rows, one sequence each.

    Returns per block (each ``[NB]`` int32, real blocks first): its sequence, its first row
    in ``q``, how many rows are real (0: padding block), and the keys ``[lo, hi)`` its rows
    may see. At most ``min(S, T)`` sequences have rows, and each wastes at most one partial
    block, so ``ceil(T / q_block) + min(S, T)`` blocks always suffice.
    """
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_lens = jnp.where(jnp.arange(S) < num_seqs, q_lens, 0)
    nblk = (q_lens + q_block - 1) // q_block
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    NB = num_tokens if q_block == 1 else -(-num_tokens // q_block) + min(S, num_tokens)
    b = jnp.arange(NB)
    seq = jnp.minimum(jnp.searchsorted(blk_end, b, side="right"), S - 1)
    first = (b - blk_start[seq]) * q_block  # first row of the block within its sequence
    rows = jnp.where(b < blk_end[-1], jnp.clip(q_lens[seq] - first, 0, q_block), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + first  # KV position of the block's first row
    lo = jnp.maximum(pos0 - window + 1, 0) if window else jnp.zeros_like(pos0)
    hi = pos0 + rows
    lo, hi = jnp.where(rows > 0, lo, 0), jnp.where(rows > 0, hi, 0)  # padding sees no key
    start = cu_q_lens[seq] + first
    return seq, start, rows, pos0, lo, hi


def _gather_pages(pages: jax.Array, ids: jax.Array) -> jax.Array:
    """KV of pages ``ids`` ``[nb, kbp]`` as ``[nb, kbp * page_size, Hkv, D]`` float32."""
    num_pages, page_size, Hkv, D = pages.shape
    nb, kbp = ids.shape
    x = pages.reshape(num_pages, -1).at[ids].get(mode="clip")  # whole pages: plain copies
    return x.reshape(nb, kbp * page_size, Hkv, D).astype(jnp.float32)


def _scores(qb: jax.Array, k: jax.Array) -> jax.Array:
    """``[nb, Hkv, Bq, G, D] x [nb, C, Hkv, D] -> [nb, Hkv, Bq, G, C]``: each query head
    against the keys of its KV head."""
    nb, Hkv, Bq, G, D = qb.shape
    if Bq > 1:
        return jnp.einsum("bkigd,bckd->bkigc", qb, k)
    # Decode: XLA:CPU runs a G-row dot per KV head poorly, after moving every gathered page
    # head-major. Against a block-diagonal query (zero outside its own head) one dot covers
    # all heads and takes the pages as gathered, at Hkv x the (small) flops.
    # (Both operands contract their minor dim: XLA:CPU's fast dot path takes that form.)
    qx = jnp.einsum("bkigd,kh->bkighd", qb, jnp.eye(Hkv, dtype=qb.dtype))
    s = jnp.einsum("bre,bce->brc", qx.reshape(nb, Hkv * G, Hkv * D), k.reshape(nb, -1, Hkv * D))
    return s.reshape(nb, Hkv, Bq, G, -1)


def _weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """``[nb, Hkv, Bq, G, C] x [nb, C, Hkv, D] -> [nb, Hkv, Bq, G, D]`` (``_scores``' twin)."""
    nb, Hkv, Bq, G, C = p.shape
    if Bq > 1:
        return jnp.einsum("bkigc,bckd->bkigd", p, v)
    o = jnp.einsum("brc,bce->bre", p.reshape(nb, Hkv * G, C), v.reshape(nb, C, -1))
    o = o.reshape(nb, Hkv, Bq, G, Hkv, -1)  # every query head against every KV head's values
    return jnp.einsum("bkighd,kh->bkigd", o, jnp.eye(Hkv, dtype=o.dtype))  # keep its own


def _attend_blocks(
    qb,  # [nb, Hkv, Bq, G, D] f32, scaled
    tables,  # [nb, max_pages] int32: each block's page table
    pos0,  # [nb] KV position of each block's first row
    lo,  # [nb] first key any row of the block sees
    hi,  # [nb] one past the last (0 = lo: padding)
    k_pages,  # [num_pages, page_size, Hkv, D]
    v_pages,
    *,
    kbp: int,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks=None,  # [Hkv, G] f32 or None
):
    """Online softmax of a few query blocks, each over its own keys ``[lo, hi)``. A sink
    is one more logit per query head in the softmax's denominator, with no value: the
    running max and denominator start from it (``exp(sink - sink) = 1``)."""
    nb, Hkv, Bq, G, D = qb.shape
    page_size = k_pages.shape[1]
    max_pages = tables.shape[1]
    first_page = lo // page_size
    n_steps = jnp.where(hi > lo, (-(-hi // page_size) - first_page + kbp - 1) // kbp, 0)
    q_pos = pos0[:, None] + jnp.arange(Bq)  # [nb, Bq]
    # Each block's page ids from its first page on, looked up once: inside the loop a plain
    # slice feeds the page gather (an id lookup fused into it would be redone per element).
    rel = first_page[:, None] + jnp.arange(max_pages + kbp)  # past the table: masked below
    ids = jnp.take_along_axis(tables, jnp.minimum(rel, max_pages - 1), axis=1)

    def body(j, carry):
        m, l, acc = carry
        page_ids = lax.dynamic_slice_in_dim(ids, j * kbp, kbp, axis=1)  # [nb, kbp]
        k = _gather_pages(k_pages, page_ids)  # [nb, C, Hkv, D]
        v = _gather_pages(v_pages, page_ids)
        page = first_page[:, None] + j * kbp + jnp.arange(kbp)  # [nb, kbp] in the sequence
        k_pos = (page[:, :, None] * page_size + jnp.arange(page_size)).reshape(nb, -1)  # [nb, C]
        kv_ok = (k_pos >= lo[:, None]) & (k_pos < hi[:, None])
        v = jnp.where(kv_ok[:, :, None, None], v, 0.0)  # 0 * NaN would survive a zero weight
        s = _scores(qb, k)  # [nb, Hkv, Bq, G, C]
        if soft_cap:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = kv_ok[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [nb, Bq, C]
        if sliding_window:
            mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
        s = jnp.where(mask[:, None, :, None, :], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with no key yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + _weighted_values(p, v)
        return m_new, l, acc

    if sinks is None:
        m0, l0 = jnp.full((nb, Hkv, Bq, G), NEG_INF, jnp.float32), jnp.zeros((nb, Hkv, Bq, G), jnp.float32)
    else:
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, :], (nb, Hkv, Bq, G))
        l0 = jnp.ones((nb, Hkv, Bq, G), jnp.float32)
    init = (m0, l0, jnp.zeros((nb, Hkv, Bq, G, D), jnp.float32))
    m, l, acc = lax.fori_loop(0, jnp.max(n_steps), body, init)
    lse = jnp.where(l == 0.0, NEG_INF, m + jnp.log(jnp.where(l == 0.0, 1.0, l)))
    return acc / jnp.where(l == 0.0, 1.0, l)[..., None], lse  # rows with no keys stay 0


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "q_block", "kv_block_pages", "return_lse"),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    kv_lens: jax.Array,  # [S] int32
    page_tables: jax.Array,  # [S, max_pages] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [] int32
    sinks: jax.Array | None = None,  # [Hq] f32: a learned logit per head (gpt-oss), or None
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    q_block: int = 8,
    kv_block_pages: int | None = None,
    return_lse: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """``return_lse``: also each row's log-sum-exp ``[T, Hq]`` float32 (the sink included;
    -inf where a row sees no key)."""
    T, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    G = Hq // Hkv
    Bq = q_block
    kbp = kv_block_pages or max(1, 128 // k_pages.shape[1])

    blocks = _query_blocks(cu_q_lens, kv_lens, num_seqs, T, Bq, sliding_window)
    chunk_bytes = 2 * kbp * math.prod(k_pages.shape[1:]) * 4  # a block's K and V chunk, f32
    nb = min(blocks[0].shape[0], max(1, kv_bytes_per_step() // chunk_bytes))  # blocks per step
    pad = -blocks[0].shape[0] % nb  # padding blocks, so the steps tile the blocks evenly
    blocks = [jnp.pad(x, (0, pad)) for x in blocks]
    out = (jnp.zeros((T, Hq, D), q.dtype), jnp.full((T, Hq), NEG_INF, jnp.float32))
    q = q.astype(jnp.float32) * sm_scale

    def step(n, carry):
        out, lse_out = carry
        # Per-block buffers hold one step's blocks: padding blocks past the last step with
        # real ones (up to S of them) never gather, compute or scatter anything.
        seq, start, rows, pos0, lo, hi = (lax.dynamic_slice_in_dim(x, n * nb, nb) for x in blocks)
        i = jnp.arange(Bq)
        q_rows = jnp.where(i < rows[:, None], start[:, None] + i, T)  # [nb, Bq]; T: none
        qb = q.at[q_rows].get(mode="fill", fill_value=0.0).reshape(nb, Bq, Hkv, G, D)
        qb = qb.transpose(0, 2, 1, 3, 4)  # [nb, Hkv, Bq, G, D]
        sink = None if sinks is None else sinks.reshape(Hkv, G)
        kw = dict(kbp=kbp, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sink)
        o, lse = _attend_blocks(qb, page_tables[seq], pos0, lo, hi, k_pages, v_pages, **kw)
        o = o.transpose(0, 2, 1, 3, 4).reshape(nb * Bq, Hq, D).astype(out.dtype)
        lse = lse.transpose(0, 2, 1, 3).reshape(nb * Bq, Hq)
        rows_out = q_rows.reshape(-1)
        return out.at[rows_out].set(o, mode="drop"), lse_out.at[rows_out].set(lse, mode="drop")

    n_real = jnp.sum(blocks[2] > 0)  # blocks with rows; they come first
    out, lse = lax.fori_loop(0, (n_real + nb - 1) // nb, step, out)
    return (out, lse) if return_lse else out


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
        return flat.at[idx].set(store(x, pages.dtype), mode="drop").reshape(shape)

    return put(k_pages, k), put(v_pages, v)
