"""Mamba2 SSD: the sequential recurrence, the reference every faster scan is checked against.

Per head ``h`` with group ``g = h // (H // G)`` and token ``t`` of a sequence::

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * outer(x_t, B_t[g])     # [P, N]
    y_t     = state_t @ C_t[g] + D_h * x_t                                  # [P]

``state_{-1}`` is the sequence's initial state (zero for a fresh sequence). Inputs are
ragged like the rest of a step: sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
``dt`` is the processed step (softplus and bias already applied).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expand_groups(b: jax.Array, num_heads: int) -> jax.Array:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    return jnp.repeat(b, num_heads // b.shape[-2], axis=-2)


def token_segments(cu_seqlens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """Per token: its sequence, whether it starts the sequence, whether it is real."""
    t = jnp.arange(num_tokens)
    seg = jnp.searchsorted(cu_seqlens[1:], t, side="right")
    valid = t < cu_seqlens[num_seqs]
    seg = jnp.minimum(seg, cu_seqlens.shape[0] - 2)
    start = t == cu_seqlens[seg]
    return seg, start, valid


@jax.jit
def ssd_sequential(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    D: jax.Array,  # [H]
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    init_states: jax.Array,  # [S, H, P, N]
) -> tuple[jax.Array, jax.Array]:  # y [T, H, P], final states [S, H, P, N]
    T, H, _ = x.shape
    seg, start, valid = token_segments(cu_seqlens, num_seqs, T)
    f32 = jnp.float32
    Bh = expand_groups(B, H).astype(f32)
    Ch = expand_groups(C, H).astype(f32)

    def step(carry, inp):
        h, finals = carry
        x_t, dt_t, b_t, c_t, s, st, ok = inp
        h = jnp.where(st, init_states[s].astype(f32), h)
        h_new = jnp.exp(dt_t * A)[:, None, None] * h + (dt_t[:, None] * x_t)[:, :, None] * b_t[:, None, :]
        y = jnp.einsum("hpn,hn->hp", h_new, c_t) + D[:, None] * x_t
        h = jnp.where(ok, h_new, h)
        finals = finals.at[jnp.where(ok, s, finals.shape[0])].set(h_new, mode="drop")
        return (h, finals), jnp.where(ok, y, 0.0)

    h0 = jnp.zeros(x.shape[1:] + (B.shape[-1],), f32)
    (_, finals), y = jax.lax.scan(
        step,
        (h0, init_states.astype(f32)),
        (x.astype(f32), dt.astype(f32), Bh, Ch, seg, start, valid),
    )
    return y, finals


def ssd_decode_step(
    state: jax.Array,  # [S, H, P, N] state before the token
    x: jax.Array,  # [S, H, P]
    dt: jax.Array,  # [S, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [S, G, N]
    C: jax.Array,  # [S, G, N]
    D: jax.Array,  # [H]
) -> tuple[jax.Array, jax.Array]:  # y [S, H, P], new state [S, H, P, N]
    """One token per sequence: the recurrence applied once."""
    H = x.shape[1]
    f32 = jnp.float32
    x, dt = x.astype(f32), dt.astype(f32)
    Bh, Ch = expand_groups(B, H).astype(f32), expand_groups(C, H).astype(f32)
    new = jnp.exp(dt * A)[..., None, None] * state.astype(f32)
    new = new + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]
    y = jnp.einsum("shpn,shn->shp", new, Ch) + D[:, None] * x
    return y, new
