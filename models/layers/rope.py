"""Rotary position embedding (the "rotate half" convention of Llama, Mistral, Gemma, Bamba),
with the frequency schedules checkpoints use: plain, linear scaling (positions / factor)
and YaRN (``YarnConfig``).

YaRN keeps the fast-rotating channels as they were trained (they complete many turns within
the original context), divides the slow ones' frequency by ``factor`` (they never turned
far enough to have seen the longer positions), and blends between the two over the
channels whose wavelength falls between ``original_max_position / beta_fast`` and
``/ beta_slow``. The rotated channels' cos and sin are scaled by ``attention_factor``
(default ``0.1 ln(factor) + 1``), which raises the attention logits' temperature.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.models.config import YarnConfig


def rope_frequencies(
    base: float, rotary_dim: int, factor: float = 1.0, yarn: YarnConfig | None = None
) -> tuple[np.ndarray, float]:
    """(inverse frequency per channel pair ``[rotary_dim / 2]`` float32, cos/sin scale)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    plain = (np.float32(1.0) / np.power(np.float32(base), exponents)).astype(np.float32)
    if yarn is None:
        return (plain / np.float32(factor)).astype(np.float32), 1.0

    def channel(turns: float) -> float:  # the channel pair that turns ``turns`` times in the context
        wavelengths = yarn.original_max_position / (turns * 2 * math.pi)
        return rotary_dim * math.log(wavelengths) / (2 * math.log(base))

    low, high = channel(yarn.beta_fast), channel(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if high == low:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: as trained (fast channels); 0: interpolated
    interpolated = plain / np.float32(yarn.factor)
    inv_freq = (interpolated * (1 - keep) + plain * keep).astype(np.float32)
    scale = yarn.attention_factor
    if scale is None:
        scale = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0
    return inv_freq, float(scale)


def apply_rope(x: jax.Array, positions: jax.Array, *, inv_freq, scale: float = 1.0) -> jax.Array:
    """Rotate the first ``2 * len(inv_freq)`` channels of each head.

    x: [T, heads, head_dim]; positions: [T]. Channels past those pass through (Bamba
    rotates half of each head).
    """
    inv_freq = np.asarray(inv_freq, np.float32)
    half = inv_freq.shape[0]
    rotary_dim = 2 * half
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, half]
    cos = (jnp.cos(angles) * scale)[:, None, :].astype(x.dtype)
    sin = (jnp.sin(angles) * scale)[:, None, :].astype(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated
