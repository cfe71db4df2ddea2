"""Gated MLP: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import jax
from flax import nnx

from hicache_jax.models.layers.linear import Linear

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, activation: str, dtype, rngs: nnx.Rngs):
        self.act = ACTIVATIONS[activation]
        self.gate_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, rngs=rngs)

    @jax.named_scope("mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
