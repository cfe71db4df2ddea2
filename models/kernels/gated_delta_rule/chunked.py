"""Gated DeltaNet as a chunked scan in plain JAX: the ``xla`` backend for ragged prefill
(transformers' ``torch_chunk_gated_delta_rule`` over ragged sequences).

Each sequence's tokens are laid out from a chunk boundary, so no chunk mixes sequences::

    flat rows   | s0: 40 tokens            | s1: 3 | s2: 20      |
    chunks(Q=16)| c0 16 | c1 16 | c2 8+pad | c3 3+pad | c4 16 | c5 4+pad |

Padding rows have ``g = beta = 0`` and ``q = k = v = 0``: they neither decay nor write the
state. Within a chunk (per head, ``cum`` the running sum of g, ``D_ij = exp(cum_i - cum_j)``
for ``j <= i``) the delta rule's updates are condensed by the UT transform::

    L     = strict_lower((beta k) k^T * D)                 # [Q, Q]
    u     = (I + L)^-1 (beta v)                            # [Q, Dv]
    w     = (I + L)^-1 (beta k * exp(cum))                 # [Q, Dk]
    v_new = u - w @ S                                      # the part S does not predict
    o     = (q * exp(cum)) @ S + ((q k^T) * D) @ v_new     # D with its diagonal
    S'    = exp(cum_Q) S + (k * exp(cum_Q - cum))^T @ v_new

``S`` is the state entering the chunk: a ``lax.scan`` over chunks carries it, restarting
from the sequence's initial state at its first chunk. The result equals the sequential
recurrence (``reference.gdn_sequential``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hicache_jax.models.kernels.chunk_layout import chunk_layout
from hicache_jax.models.kernels.gated_delta_rule.reference import F32, HIGHEST, gdn_decode_step
from hicache_jax.models.kernels.mamba2_ssd.chunked import gather_states, scatter_states

einsum = functools.partial(jnp.einsum, precision=HIGHEST)


def ut_inverse(L: jax.Array) -> jax.Array:
    """``(I + L)^-1`` for strictly lower-triangular ``L`` [..., Q, Q].

    Doubling the diagonal blocks: with ``T`` the inverse of (I + L)'s diagonal blocks of size
    b, the blocks of size 2b are ``T - T (L * M_b) T``, ``M_b`` the mask of each 2b block's
    lower-left quadrant: the recursive block inverse [[T1, 0], [-T2 L21 T1, T2]] for all
    blocks at once, ceil(log2(Q)) levels of two matmuls (any Q: the blocks are those of the
    next power of two). As accurate as forward substitution here,
    while a Neumann-series product ((I - L)(I + L^2)(I + L^4)...) is not: with near-equal
    keys under slow decay its factors reach 1e9 while the inverse stays O(1). The Pallas
    kernel does the same (``kernel._ut_inverse``); XLA's triangular solve took 2 s of CPU
    compile time on its own."""
    Q = L.shape[-1]
    i, j = jnp.arange(Q)[:, None], jnp.arange(Q)[None, :]
    T = jnp.broadcast_to(jnp.eye(Q, dtype=F32), L.shape)
    b = 1
    while b < Q:
        high = ~(2 * b - 1)
        quadrant = ((i & high) == (j & high)) & ((i & b) != 0) & ((j & b) == 0)
        T = T - einsum("...ij,...jk,...kl->...il", T, jnp.where(quadrant, L, 0.0), T)
        b *= 2
    return T


@functools.partial(jax.jit, static_argnames=("chunk",))
def gdn_chunked(
    q: jax.Array,  # [T, H, Dk] l2-normalised, scaled by Dk ** -0.5
    k: jax.Array,  # [T, H, Dk] l2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H] log-decay, <= 0
    beta: jax.Array,  # [T, H]
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    init_states: jax.Array,  # [S, H, Dk, Dv]
    *,
    chunk: int = 64,
) -> tuple[jax.Array, jax.Array]:  # o [T, H, Dv] float32, final states [S, H, Dk, Dv]
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    Q = chunk
    dest, c_seq, c_first, last, q_lens, NC = chunk_layout(cu_seqlens, num_seqs, T, Q)

    def lay(a):  # [T, H, ...] -> [NC, H, Q, ...]
        z = jnp.zeros((NC * Q,) + a.shape[1:], F32)
        a = z.at[dest].set(a.astype(F32), mode="drop").reshape((NC, Q) + a.shape[1:])
        return jnp.moveaxis(a, 1, 2)

    qc, kc, vc, gc, bc = (lay(a) for a in (q, k, v, g, beta))  # [NC, H, Q, D] / [NC, H, Q]
    cum = jnp.cumsum(gc, axis=-1)  # [NC, H, Q], <= 0
    causal = jnp.tril(jnp.ones((Q, Q), bool))
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [NC,H,Qi,Qj]
    kb = kc * bc[..., None]  # [NC, H, Q, Dk]
    L = jnp.where(jnp.tril(causal, -1), einsum("chik,chjk->chij", kb, kc) * decay, 0.0)
    T_ut = ut_inverse(L)  # [NC, H, Q, Q]
    u = einsum("chij,chjv->chiv", T_ut, vc * bc[..., None])  # [NC, H, Q, Dv]
    w = einsum("chij,chjk->chik", T_ut, kb * jnp.exp(cum)[..., None])  # [NC, H, Q, Dk]
    k_end = kc * jnp.exp(cum[..., -1:] - cum)[..., None]  # [NC, H, Q, Dk]
    chunk_decay = jnp.exp(cum[..., -1])  # [NC, H]
    h0 = init_states.astype(F32)

    def step(prev, inp):
        first, s, u_c, w_c, k_c, dec = inp
        incoming = jnp.where(first, h0[s], prev)  # [H, Dk, Dv]
        v_new = u_c - einsum("hqk,hkv->hqv", w_c, incoming)
        end = dec[:, None, None] * incoming + einsum("hqk,hqv->hkv", k_c, v_new)
        return end, (end, incoming, v_new)

    xs = (c_first, c_seq, u, w, k_end, chunk_decay)
    _, (ends, incoming, v_new) = jax.lax.scan(step, jnp.zeros((H, Dk, Dv), F32), xs)
    attn = einsum("chik,chjk->chij", qc, kc) * decay
    o = einsum("chqk,chkv->chqv", qc * jnp.exp(cum)[..., None], incoming)
    o = o + einsum("chij,chjv->chiv", attn, v_new)  # [NC, H, Q, Dv]
    o = jnp.moveaxis(o, 2, 1).reshape(NC * Q, H, Dv).at[jnp.minimum(dest, NC * Q - 1)].get()
    o = jnp.where((dest < NC * Q)[:, None, None], o, 0.0)
    finals = jnp.where((q_lens > 0)[:, None, None, None], ends[last], h0)
    return o, finals


def gdn_slots(q, k, v, g, beta, cu_seqlens, num_seqs, states, slots, has_initial_state):
    """Slot-indexed prefill: read each sequence's state from ``states[slots[s]]`` (when
    ``has_initial_state[s]``), scan, and write the final state back to that slot.

    states: [num_slots, H, Dk, Dv] float32 -> returns (o [T, H, Dv] float32, updated states)."""
    h0, live = gather_states(states, slots, has_initial_state, num_seqs)
    o, finals = gdn_chunked(q, k, v, g, beta, cu_seqlens, num_seqs, h0)
    return o, scatter_states(states, slots, live, finals)


def gdn_decode_slots(q, k, v, g, beta, cu_seqlens, num_seqs, states, slots, has_initial_state):
    """Slot-indexed one-token update for a decode-only batch (sequence s's token at row
    ``cu_seqlens[s]``); same signature and result as ``gdn_slots``."""
    T = q.shape[0]
    S = slots.shape[0]
    h0, live = gather_states(states, slots, has_initial_state, num_seqs)
    rows = jnp.clip(cu_seqlens[:-1], 0, T - 1)
    o_seq, new = gdn_decode_step(h0, q[rows], k[rows], v[rows], g[rows], beta[rows])
    dest = jnp.where(jnp.arange(S) < num_seqs, rows, T)
    o = jnp.zeros((T,) + v.shape[1:], F32).at[dest].set(o_seq, mode="drop")
    return o, scatter_states(states, slots, live, new)
