"""Rotary position embedding (the "rotate half" convention of Llama, Mistral, Gemma, Bamba)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(
    x: jax.Array, positions: jax.Array, *, base: float, rotary_dim: int, factor: float = 1.0
) -> jax.Array:
    """Rotate the first ``rotary_dim`` channels of each head.

    x: [T, heads, head_dim]; positions: [T]. Channels past ``rotary_dim`` pass through
    (Bamba rotates half of each head). ``factor`` is linear rope scaling.
    """
    half = rotary_dim // 2
    inv_freq = 1.0 / (base ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    inv_freq = inv_freq / factor
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated
