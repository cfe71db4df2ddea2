"""The chunk-aligned layout both chunked recurrent scans (Mamba2 SSD, Gated DeltaNet) use
on the ``xla`` path: each sequence's rows laid out from a chunk boundary, so no chunk
mixes sequences::

    flat rows   | s0: 40 tokens            | s1: 3 | s2: 20      |
    chunks(Q=16)| c0 16 | c1 16 | c2 8+pad | c3 3+pad | c4 16 | c5 4+pad |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunk_layout(cu_seqlens: jax.Array, num_seqs: jax.Array, num_rows: int, chunk: int):
    """Where each row goes in the chunk-aligned layout, and which sequence each chunk is.

    Returns (dest [T]: row in the [NC * Q] layout, NC * Q for padding rows; c_seq [NC];
    c_first [NC]: the chunk starts its sequence; last [S]: each sequence's last chunk;
    q_lens [S]; NC)."""
    T, Q = num_rows, chunk
    S = cu_seqlens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(S) < num_seqs, cu_seqlens[1:] - cu_seqlens[:-1], 0)
    nch = (q_lens + Q - 1) // Q
    ch_end = jnp.cumsum(nch)
    ch_start = ch_end - nch
    NC = -(-T // Q) + S
    t = jnp.arange(T)
    seg = jnp.minimum(jnp.searchsorted(cu_seqlens[1:], t, side="right"), S - 1)
    valid = t < cu_seqlens[num_seqs]
    dest = jnp.where(valid, ch_start[seg] * Q + (t - cu_seqlens[seg]), NC * Q)
    c = jnp.arange(NC)
    c_seq = jnp.minimum(jnp.searchsorted(ch_end, c, side="right"), S - 1)
    c_first = c == ch_start[c_seq]
    return dest, c_seq, c_first, jnp.maximum(ch_end - 1, 0), q_lens, NC
