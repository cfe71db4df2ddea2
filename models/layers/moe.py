"""Mixture-of-experts MLP, dropless: every token reaches each of its ``top_k`` experts, so
the layer equals its dense definition whatever the routing (no capacity, no dropped token).

Routing (``route``), per family:
- ``softmax_topk`` (Qwen3-MoE): softmax over all experts in float32, the top-k of those
  probabilities, renormalised to sum to 1 when ``norm_topk_prob``.
- ``topk_softmax`` (gpt-oss): the top-k router logits (the router has a bias), softmax over
  those k alone.

Experts (``expert_mlp``): ``silu`` is ``down(silu(gate) * up)``; ``swiglu_clamped``
(gpt-oss) clamps gate above at ``limit`` and up to ``[-limit, limit]``, then
``down((up + 1) * gate * sigmoid(alpha * gate))``; both with optional per-expert biases.
Weights are held as ``gate_up [E, H, 2I]`` (gate in the first half, up in the second) and
``down [E, I, H]``; the checkpoint loaders put each family's layout into this one.

``moe_ragged`` computes the experts as a grouped matmul: the ``T * k`` (token, expert)
assignments are sorted by expert, and ``jax.lax.ragged_dot`` multiplies each expert's
contiguous rows by its weights, so the work is the active experts' rows only.
``moe_dense_reference`` runs every expert on every token and weighs the results by a dense
``[T, E]`` routing matrix: the plain definition the tests hold the grouped path to.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.models.layers.linear import Linear

ROUTERS = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate: int  # per expert
    router: str = "softmax_topk"  # ROUTERS
    norm_topk_prob: bool = False  # softmax_topk: renormalise the chosen probabilities
    router_bias: bool = False
    expert_bias: bool = False  # gate_up and down biases per expert (gpt-oss)
    activation: str = "silu"  # EXPERT_ACTIVATIONS
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r}: must be one of {ROUTERS}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: must be one of {EXPERT_ACTIVATIONS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k}: must be in [1, num_experts={self.num_experts}]")


def route(logits: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits ``[T, E]`` -> (weights ``[T, k]`` float32, experts ``[T, k]`` int32)."""
    if cfg.router == "softmax_topk":
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, cfg.top_k)
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    else:
        top, experts = jax.lax.top_k(logits, cfg.top_k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
    return weights, experts.astype(jnp.int32)


def expert_activation(gate_up: jax.Array, cfg: MoEConfig) -> jax.Array:
    """``[..., 2I]`` (gate, then up) -> ``[..., I]``."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    if cfg.activation == "silu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, cfg.swiglu_limit)
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def moe_ragged(x, weights, experts, gate_up, down, cfg: MoEConfig, gate_up_bias=None, down_bias=None):
    """``x [T, H]`` through each token's experts, weighted and summed: ``[T, H]``."""
    T, H = x.shape
    k = experts.shape[1]
    flat = experts.reshape(-1)  # assignment a = t * k + j
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    rows = x[order // k]  # [T*k, H]
    sorted_experts = flat[order]
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    h = jax.lax.ragged_dot(rows, gate_up, group_sizes)  # [T*k, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias[sorted_experts]
    h = expert_activation(h, cfg).astype(x.dtype)
    y = jax.lax.ragged_dot(h, down, group_sizes)  # [T*k, H]
    if down_bias is not None:
        y = y + down_bias[sorted_experts]
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((T * k, H), jnp.float32).at[order].set(y)  # back in assignment order
    return out.reshape(T, k, H).sum(axis=1).astype(x.dtype)


def moe_dense_reference(
    x, weights, experts, gate_up, down, cfg: MoEConfig, gate_up_bias=None, down_bias=None
):
    """The definition: every expert on every token, weighed by the dense routing matrix."""
    T = x.shape[0]
    dense = jnp.zeros((T, cfg.num_experts), jnp.float32).at[jnp.arange(T)[:, None], experts].add(weights)
    h = jnp.einsum("th,ehf->tef", x, gate_up)
    if gate_up_bias is not None:
        h = h + gate_up_bias[None]
    h = expert_activation(h, cfg).astype(x.dtype)
    y = jnp.einsum("tei,eih->teh", h, down)
    if down_bias is not None:
        y = y + down_bias[None]
    return jnp.einsum("teh,te->th", y.astype(jnp.float32), dense).astype(x.dtype)


class MoE(nnx.Module):
    """Router + experts; ``__call__`` takes ``[..., H]`` and returns the same shape."""

    def __init__(self, hidden: int, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        E, I = cfg.num_experts, cfg.intermediate
        self.router = Linear(hidden, E, bias=cfg.router_bias, dtype=dtype, rngs=rngs)
        normal = lambda shape, fan_in: (jax.random.normal(rngs.params(), shape) * fan_in**-0.5).astype(dtype)  # noqa: E731
        self.gate_up = nnx.Param(normal((E, hidden, 2 * I), hidden))
        self.down = nnx.Param(normal((E, I, hidden), I))
        self.gate_up_bias = nnx.Param(jnp.zeros((E, 2 * I), dtype)) if cfg.expert_bias else None
        self.down_bias = nnx.Param(jnp.zeros((E, hidden), dtype)) if cfg.expert_bias else None

    def biases(self) -> tuple:
        if self.gate_up_bias is None:
            return None, None
        return self.gate_up_bias[...], self.down_bias[...]

    @jax.named_scope("moe")
    def __call__(self, x: jax.Array, *, reference: bool = False) -> jax.Array:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, experts = route(self.router(x2), self.cfg)
        fn = moe_dense_reference if reference else moe_ragged
        out = fn(x2, weights, experts, self.gate_up[...], self.down[...], self.cfg, *self.biases())
        return out.reshape(shape)
