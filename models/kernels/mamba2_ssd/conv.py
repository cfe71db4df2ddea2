"""Causal depthwise conv1d over a ragged batch, with per-sequence carried-in state.

Each sequence carries the last ``K - 1`` conv inputs of its past (zeros when fresh)::

    window of token o of a sequence: inputs o-K+1 .. o
                                     (negative rows come from the carried state)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hicache_jax.models.kernels.mamba2_ssd.reference import token_segments


def causal_conv1d(
    x: jax.Array,  # [T, C] conv inputs
    weight: jax.Array,  # [K, C]
    bias: jax.Array | None,  # [C]
    state: jax.Array,  # [S, K - 1, C] carried inputs, oldest first (zeros when fresh)
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
) -> tuple[jax.Array, jax.Array]:  # out [T, C] (before activation), new state [S, K - 1, C]
    T = x.shape[0]
    K = weight.shape[0]
    S = state.shape[0]
    seg, _, valid = token_segments(cu_seqlens, num_seqs, T)
    off = jnp.arange(T) - cu_seqlens[seg]  # row within its sequence

    def window_rows(seq, row):  # row < 0 reads the carried state
        from_x = x[jnp.clip(cu_seqlens[seq] + row, 0, T - 1)]
        from_state = state[seq, jnp.clip(K - 1 + row, 0, K - 2)]
        return jnp.where((row >= 0)[..., None], from_x, from_state)

    out = jnp.zeros(x.shape, jnp.float32)
    for k in range(K):  # tap k reads row o - (K-1) + k
        out = out + window_rows(seg, off - (K - 1) + k).astype(jnp.float32) * weight[k]
    if bias is not None:
        out = out + bias
    out = jnp.where(valid[:, None], out, 0.0).astype(x.dtype)

    s = jnp.arange(S)
    q_lens = jnp.where(s < num_seqs, cu_seqlens[1:] - cu_seqlens[:-1], 0)
    rows = q_lens[:, None] - (K - 1) + jnp.arange(K - 1)[None, :]  # [S, K-1]
    new_state = window_rows(s[:, None], rows).astype(state.dtype)
    return out, new_state
