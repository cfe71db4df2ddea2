"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the sequential recurrence, the
reference every faster form is checked against.

Per value head ``h`` and token ``t`` of a sequence, with state ``S`` [Dk, Dv] (float32)::

    S     = exp(g_t) * S                          # g_t <= 0: log-decay
    delta = beta_t * (v_t - k_t @ S)              # [Dv], beta_t in (0, 1)
    S     = S + outer(k_t, delta)                 # [Dk, Dv]
    o_t   = q_t @ S                               # [Dv]

``S`` starts from the sequence's initial state (zero for a fresh sequence). The kernels take
q and k already l2-normalised (``l2norm``), q already scaled by ``Dk ** -0.5`` and both
repeated to the value heads: the layer does that. Inputs are ragged like the rest of a step:
sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.

This is transformers' ``torch_recurrent_gated_delta_rule`` (which l2-normalises and scales
q itself) over ragged sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hicache_jax.models.kernels.mamba2_ssd.reference import token_segments

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in float32 (transformers' ``l2norm``)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _update(state, q, k, v, g, beta):
    """One token for every head (and leading batch dims): ``state`` [..., H, Dk, Dv],
    q, k [..., H, Dk], v [..., H, Dv], g, beta [..., H] -> (o [..., H, Dv], new state)."""
    state = jnp.exp(g)[..., None, None] * state
    kv = jnp.einsum("...hk,...hkv->...hv", k, state, precision=HIGHEST)
    delta = beta[..., None] * (v - kv)
    state = state + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("...hk,...hkv->...hv", q, state, precision=HIGHEST)
    return o, state


@jax.jit
def gdn_sequential(
    q: jax.Array,  # [T, H, Dk] l2-normalised, scaled by Dk ** -0.5
    k: jax.Array,  # [T, H, Dk] l2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H] log-decay, <= 0
    beta: jax.Array,  # [T, H] in (0, 1)
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    init_states: jax.Array,  # [S, H, Dk, Dv]
) -> tuple[jax.Array, jax.Array]:  # o [T, H, Dv] float32, final states [S, H, Dk, Dv]
    """The recurrence token by token. Rows past ``cu_seqlens[num_seqs]`` give o = 0; a
    sequence with no tokens keeps its initial state."""
    T = q.shape[0]
    seg, start, valid = token_segments(cu_seqlens, num_seqs, T)

    def step(carry, inp):
        state, finals = carry
        q_t, k_t, v_t, g_t, b_t, s, st, ok = inp
        state = jnp.where(st, init_states[s].astype(F32), state)
        o, new = _update(state, q_t, k_t, v_t, g_t, b_t)
        state = jnp.where(ok, new, state)
        finals = finals.at[jnp.where(ok, s, finals.shape[0])].set(new, mode="drop")
        return (state, finals), jnp.where(ok, o, 0.0)

    h0 = jnp.zeros(init_states.shape[1:], F32)
    inputs = tuple(a.astype(F32) for a in (q, k, v, g, beta)) + (seg, start, valid)
    (_, finals), o = jax.lax.scan(step, (h0, init_states.astype(F32)), inputs)
    return o, finals


def gdn_decode_step(
    state: jax.Array,  # [S, H, Dk, Dv] state before the token
    q: jax.Array,  # [S, H, Dk]
    k: jax.Array,  # [S, H, Dk]
    v: jax.Array,  # [S, H, Dv]
    g: jax.Array,  # [S, H]
    beta: jax.Array,  # [S, H]
) -> tuple[jax.Array, jax.Array]:  # o [S, H, Dv] float32, new state [S, H, Dk, Dv]
    """One token per sequence: the recurrence applied once."""
    f = lambda a: a.astype(F32)
    return _update(f(state), f(q), f(k), f(v), f(g), f(beta))
