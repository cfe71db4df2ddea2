"""A lightning indexer's scores over a paged key pool, in plain JAX: the reference for the
Pallas kernel (``kernel.py``).

Each query token ``t`` of a ragged batch (its sequence ``seq[t]``, its last visible row
``last[t]``; ``-1``: sees nothing) scores every row ``j <= last[t]`` of its sequence::

    score(t, j) = sum_h w[t, h] * relu(q[t, h, :] . k[j, :])
    k[j]        = keys[table[seq[t], j // rows], j % rows]

as float32 ``[T, max_pages * rows]``, ``-inf`` where the row is not visible. The queries
meet the keys in the keys' dtype (products exact in float32, accumulated in float32), as
the kernel's matmul does; 8-bit (quantized) keys meet the queries in the queries' dtype
instead (``meet_dtype``). ``lax.top_k`` over the scores is the caller's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def meet_dtype(keys_dtype, q_dtype) -> jnp.dtype:
    """The dtype queries and keys are multiplied in: the keys', unless they are 8-bit
    (quantized pages, whose values the queries' dtype holds exactly)."""
    keys_dtype = jnp.dtype(keys_dtype)
    return jnp.dtype(q_dtype) if keys_dtype.itemsize == 1 else keys_dtype


def index_scores(
    q: jax.Array,  # [T, Hi, d]
    w: jax.Array,  # [T, Hi]
    keys: jax.Array,  # [num_pages, rows, d]
    table: jax.Array,  # [S, max_pages] int32
    seq: jax.Array,  # [T] int32
    last: jax.Array,  # [T] int32: the last row each token sees (-1: none)
) -> jax.Array:  # [T, max_pages * rows] float32
    T = q.shape[0]
    N = table.shape[1] * keys.shape[1]
    rows = keys[table[seq]].reshape(T, N, -1).astype(jnp.float32)  # [T, N, d]
    seen = jnp.arange(N)[None, :] <= last[:, None]
    rows = jnp.where(seen[..., None], rows, 0.0)  # unused pages may hold anything (NaN)
    qk = jnp.einsum("thd,tkd->thk", q.astype(meet_dtype(keys.dtype, q.dtype)).astype(jnp.float32), rows)
    total = jnp.einsum("th,thk->tk", w.astype(jnp.float32), jax.nn.relu(qk))
    return jnp.where(seen, total, NEG_INF)
