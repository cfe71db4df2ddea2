"""Dense projections and the token embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with ``kernel: [in, out]``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        scale = in_features**-0.5
        self.kernel = nnx.Param(
            (jax.random.normal(rngs.params(), (in_features, out_features)) * scale).astype(dtype)
        )
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embed(nnx.Module):
    """Token embedding ``[vocab, hidden]``; ``attend`` reuses it as a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(
            jax.random.normal(rngs.params(), (vocab_size, hidden_size)).astype(dtype) * 0.02
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...h,vh->...v", x, self.embedding[...])
