"""Attention over per-token row lists of a paged pool, in plain JAX: the reference for the
Pallas kernel (``kernel.py``) and the ``xla`` backend.

Each query token ``t`` of a ragged batch reads its own rows ``idx[t, :]`` (row indices
within its sequence ``seq[t]``; negative: no row) of a pool ``[num_pages, rows, D]`` through
the sequence's page table; keys and values are the same rows (one shared K=V head, as
DeepSeek V4's window and compressed entries, or an MLA latent)::

    idx[t]   = [ 5, 9, 130, -1, ... ]        rows of sequence seq[t]
    row r    = pages[table[seq[t], r // rows], r % rows]

The result is each head's softmax-weighted mean and its log-sum-exp (float32, no sink), so
a caller that attends over several sources (a window pool and a compressed pool) merges
them, and a sink logit, exactly (``merge``). A token with no valid row gets ``o = 0`` and
``lse = -inf``; rows not named, and pages not reached, are never mixed in (they may be NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def row_ids(table: jax.Array, seq: jax.Array, idx: jax.Array, rows_per_page: int) -> jax.Array:
    """Flat rows ``[T, N]`` of ``pages.reshape(-1, D)`` for ``idx [T, N]``; -1 where
    ``idx < 0`` or past the table (its entries there are never read into a row)."""
    max_pages = table.shape[1]
    page_of = idx // rows_per_page
    ok = (idx >= 0) & (page_of < max_pages)
    page = jnp.take_along_axis(table[seq], jnp.clip(page_of, 0, max_pages - 1), axis=1)
    return jnp.where(ok, page * rows_per_page + idx % rows_per_page, -1).astype(jnp.int32)


def paged_row_attention(
    q: jax.Array,  # [T, H, D]
    pages: jax.Array,  # [num_pages, rows, D]
    table: jax.Array,  # [S, max_pages] int32
    seq: jax.Array,  # [T] int32: each token's sequence
    idx: jax.Array,  # [T, N] int32: rows within the sequence; < 0: none
    *,
    sm_scale: float,
) -> tuple[jax.Array, jax.Array]:  # o [T, H, D] f32, lse [T, H] f32
    flat = row_ids(table, seq, idx, pages.shape[1])
    valid = flat >= 0
    rows = pages.reshape(-1, pages.shape[-1])[jnp.maximum(flat, 0)]  # [T, N, D]
    rows = jnp.where(valid[..., None], rows.astype(jnp.float32), 0.0)  # unnamed rows may be NaN
    s = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), rows) * sm_scale
    s = jnp.where(valid[:, None], s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    e = jnp.exp(s - m_safe)  # 0 where invalid
    l = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("thn,tnd->thd", e / jnp.where(l == 0.0, 1.0, l), rows)
    lse = jnp.where(l[..., 0] == 0.0, NEG_INF, m_safe[..., 0] + jnp.log(l[..., 0]))
    return o, lse


def merge(parts: list[tuple[jax.Array, jax.Array]], sinks: jax.Array | None = None) -> jax.Array:
    """One softmax over several sources' rows and a sink logit per head (no value):
    ``parts`` are ``(o [T, H, D], lse [T, H])`` each, ``sinks [H]``; float32 ``[T, H, D]``::

        o = sum_i o_i exp(lse_i - m) / (sum_i exp(lse_i - m) + exp(sink - m))
    """
    lses = [lse for _, lse in parts]
    if sinks is not None:
        lses.append(jnp.broadcast_to(sinks.astype(jnp.float32)[None, :], lses[0].shape))
    m = _max_of(lses)
    m = jnp.where(m == NEG_INF, 0.0, m)
    weights = [jnp.exp(lse - m) for lse in lses]  # exp(-inf) = 0: an empty source adds nothing
    denom = sum(weights)
    denom = jnp.where(denom == 0.0, 1.0, denom)
    return sum(o * (w / denom)[..., None] for (o, _), w in zip(parts, weights))


def _max_of(xs: list[jax.Array]) -> jax.Array:
    out = xs[0]
    for x in xs[1:]:
        out = jnp.maximum(out, x)
    return out
