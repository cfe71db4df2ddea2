"""Dense MLP: gated ``down(act(gate(x)) * up(x))`` or plain ``down(act(up(x)))``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.models.layers.linear import Linear

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # squared ReLU (Nemotron-H)
}


class MLP(nnx.Module):
    """``gated``: ``down(act(gate(x)) * up(x))`` (Llama and most since); otherwise
    ``down(act(up(x)))`` (Nemotron-H's squared-ReLU MLP), with no ``gate_proj``. ``limit``
    (DeepSeek V4's shared expert): gate clamped above at it, up to ``[-limit, limit]``."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        activation: str,
        dtype,
        rngs: nnx.Rngs,
        gated: bool = True,
        limit: float | None = None,
    ):
        self.act = ACTIVATIONS[activation]
        self.limit = limit
        self.gate_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, rngs=rngs) if gated else None
        self.up_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, rngs=rngs)

    @jax.named_scope("mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
        return self.down_proj(self.act(gate) * up)
