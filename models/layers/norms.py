"""RMS norms, computed in float32 whatever the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``w * x / rms(x)``; with ``offset=1`` (Gemma) the scale is ``1 + w``."""

    def __init__(self, dim: int, *, eps: float, offset: float = 0.0, dtype):
        self.eps = eps
        self.offset = offset
        # Stored as a checkpoint stores it: Gemma's zero-initialised w means scale 1.
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.weight[...].astype(jnp.float32) + self.offset
        if self.offset:  # Gemma scales in float32, then casts
            return (rms_normalize(x, self.eps) * scale).astype(x.dtype)
        return self.weight[...] * rms_normalize(x, self.eps).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """A norm gated by ``silu(gate)``, over groups of ``group_size`` channels of the last
    axis (``dim`` channels, one weight each):

    - Mamba2: ``w * rms_norm(x * silu(gate))`` (the gate before the norm);
    - ``norm_before_gate`` (Gated DeltaNet): ``w * rms_norm(x) * silu(gate)``.
    """

    def __init__(self, dim: int, group_size: int, *, eps: float, dtype, norm_before_gate: bool = False):
        if dim % group_size:
            raise ValueError(f"GatedRMSNorm: dim {dim} is not a multiple of group_size {group_size}")
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        silu = jax.nn.silu(gate.astype(jnp.float32))
        h = x.astype(jnp.float32) if self.norm_before_gate else x.astype(jnp.float32) * silu
        *lead, dim = h.shape
        h = rms_normalize(h.reshape(*lead, dim // self.group_size, self.group_size), self.eps)
        h = self.weight[...] * h.reshape(*lead, dim).astype(x.dtype)
        if self.norm_before_gate:  # transformers' Qwen3NextRMSNormGated: the gate in float32
            h = (h.astype(jnp.float32) * silu).astype(x.dtype)
        return h


class LayerNorm(nnx.Module):
    """``w * (x - mean) / std + b`` in float32 (a sparse-attention indexer's key norm)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h - jnp.mean(h, axis=-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)
