"""Mixture-of-experts MLP, dropless: every token reaches each of its ``top_k`` experts, so
the layer equals its dense definition whatever the routing (no capacity, no dropped token).

Routing (``route``), per family:
- ``softmax_topk`` (Qwen3-MoE): softmax over all experts in float32, the top-k of those
  probabilities, renormalised to sum to 1 when ``norm_topk_prob``.
- ``topk_softmax`` (gpt-oss, Granite): the top-k router logits (gpt-oss's router has a
  bias), softmax over those k alone.
- ``sigmoid_topk`` (DeepSeek-V3's, in Nemotron-H): sigmoid scores in float32; the experts
  are chosen by score plus a learned per-expert correction bias, within the ``topk_groups``
  best of ``num_groups`` equal expert groups (a group ranks by the sum of its top two), and
  weighted by their scores without the bias, renormalised when ``norm_topk_prob``, times
  ``routed_scaling``.

Experts (``expert_activation``): ``silu`` is ``down(silu(gate) * up)``; ``swiglu_clamped``
(gpt-oss) clamps gate above at ``limit`` and up to ``[-limit, limit]``, then
``down((up + 1) * gate * sigmoid(alpha * gate))``; ``relu2`` (Nemotron-H) is not gated:
``down(relu(up) ** 2)``; all with optional per-expert biases. Weights are held as
``gate_up [E, H, 2I]`` (gate in the first half, up in the second; ``[E, H, I]``, up alone,
for ``relu2``) and ``down [E, I, H]``; the checkpoint loaders put each family's layout into
this one.

A shared expert (``MoEConfig.shared_intermediate``) is a dense MLP beside the routed ones,
run on every token; under tensor parallelism it is split like any dense MLP (columns of
its gate and up, rows of its down), while the routed experts are split whole.

``moe_ragged`` computes the experts as a grouped matmul: the ``T * k`` (token, expert)
assignments are sorted by expert, and ``jax.lax.ragged_dot`` multiplies each expert's
contiguous rows by its weights, so the work is the active experts' rows only.
``moe_dense_reference`` runs every expert on every token and weighs the results by a dense
``[T, E]`` routing matrix: the plain definition the tests hold the grouped path to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from hicache_jax.models.config import EXPERT_ACTIVATIONS, ROUTERS, MoEConfig  # noqa: F401 (re-exported)
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.mlp import MLP
from hicache_jax.models.sharding import AXIS


def route(
    logits: jax.Array, cfg: MoEConfig, correction: jax.Array | None = None, experts: jax.Array | None = None
) -> tuple[jax.Array, ...]:
    """Router logits ``[T, E]`` -> (weights ``[T, k]`` float32, experts ``[T, k]`` int32).
    ``correction [E]``: ``sigmoid_topk``'s bias on the choice (not on the weights).
    ``experts [T, k]``: the choice made already (DeepSeek V4's hash layers: by token id);
    the scores still weigh them."""
    if cfg.router == "softmax_topk":
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, cfg.top_k)
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    elif cfg.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, cfg.top_k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
    else:
        logits = logits.astype(jnp.float32)
        scores = jax.nn.sigmoid(logits) if cfg.router == "sigmoid_topk" else jnp.sqrt(jax.nn.softplus(logits))
        choice = scores if correction is None else scores + correction.astype(jnp.float32)
        if experts is None and cfg.num_groups > 1:
            T, E, G = scores.shape[0], cfg.num_experts, cfg.num_groups
            group_score = jax.lax.top_k(choice.reshape(T, G, E // G), 2)[0].sum(axis=-1)  # [T, G]
            best = jax.lax.top_k(group_score, cfg.topk_groups)[1]
            keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], best].set(True)
            choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
        if experts is None:
            experts = jax.lax.top_k(choice, cfg.top_k)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        weights = weights * cfg.routed_scaling
    return weights, experts.astype(jnp.int32)


def expert_activation(gate_up: jax.Array, cfg: MoEConfig) -> jax.Array:
    """``[..., 2I]`` (gate, then up) -> ``[..., I]``; ``relu2``: ``[..., I]`` (up) -> same."""
    if cfg.activation == "relu2":
        return jnp.square(jax.nn.relu(gate_up))
    gate, up = jnp.split(gate_up, 2, axis=-1)
    if cfg.activation == "silu":
        return jax.nn.silu(gate) * up
    if cfg.activation == "silu_clamped":
        return jax.nn.silu(jnp.minimum(gate, cfg.swiglu_limit)) * jnp.clip(
            up, -cfg.swiglu_limit, cfg.swiglu_limit
        )
    gate = jnp.minimum(gate, cfg.swiglu_limit)
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def moe_ragged(
    x, weights, experts, gate_up, down, cfg: MoEConfig, gate_up_bias=None, down_bias=None, groups=None
):
    """``x [T, H]`` through each token's experts, weighted and summed: ``[T, H]``.

    ``groups``: how many experts ``gate_up`` / ``down`` hold (default all). An assignment to
    expert ``groups`` is to none held here: it sorts last, past every group, and adds 0."""
    T, H = x.shape
    k = experts.shape[1]
    G = cfg.num_experts if groups is None else groups
    flat = experts.reshape(-1)  # assignment a = t * k + j
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    rows = x[order // k]  # [T*k, H]
    sorted_experts = flat[order]
    group_sizes = jnp.bincount(flat, length=G + 1)[:G].astype(jnp.int32)
    held = sorted_experts < G
    # Explicit: under jax_default_matmul_precision=highest (the tests') XLA's TPU ragged_dot
    # would ask Mosaic for an f32 contraction of bf16 operands, which it refuses.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    h = jax.lax.ragged_dot(rows, gate_up, group_sizes, precision=precision)  # [T*k, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias[jnp.minimum(sorted_experts, G - 1)]
    h = expert_activation(h, cfg).astype(x.dtype)
    y = jax.lax.ragged_dot(h, down, group_sizes, precision=precision)  # [T*k, H]
    if down_bias is not None:
        y = y + down_bias[jnp.minimum(sorted_experts, G - 1)]
    # Rows past the groups are left undefined by ragged_dot: zeroed, not merely weighed 0.
    y = jnp.where(held[:, None], y.astype(jnp.float32) * weights.reshape(-1)[order][:, None], 0.0)
    out = jnp.zeros((T * k, H), jnp.float32).at[order].set(y)  # back in assignment order
    return out.reshape(T, k, H).sum(axis=1).astype(x.dtype)


def moe_gathered(
    x, weights, experts, gate_up, down, cfg: MoEConfig, gate_up_bias=None, down_bias=None, groups=None
):
    """``moe_ragged``'s result without ``ragged_dot``, for CPU, where XLA lowers ragged_dot
    densely: every expert against every row, after copying the whole weight into a new
    layout on every call (12-20 ms a layer at the 100m-moe preset, whatever the batch).

    With fewer assignments than experts (decode) each assignment gathers its expert's
    weights, so a step reads the experts it uses; with more, every expert runs on every
    token, weighed by the dense routing matrix, so each weight is read once."""
    T, H = x.shape
    k = experts.shape[1]
    G = cfg.num_experts if groups is None else groups
    held = experts < G
    weights = jnp.where(held, weights, 0.0)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    if T * k < G:
        e = jnp.minimum(experts, G - 1).reshape(-1)  # assignment a = t * k + j
        rows = jnp.repeat(x, k, axis=0)
        h = jnp.einsum("ah,ahf->af", rows, gate_up[e], precision=precision)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        h = expert_activation(h, cfg).astype(x.dtype)
        y = jnp.einsum("ai,aih->ah", h, down[e], precision=precision)
        if down_bias is not None:
            y = y + down_bias[e]
        y = jnp.where(held.reshape(-1)[:, None], y.astype(jnp.float32) * weights.reshape(-1)[:, None], 0.0)
        return y.reshape(T, k, H).sum(axis=1).astype(x.dtype)
    dense = jnp.zeros((T, G), jnp.float32).at[jnp.arange(T)[:, None], experts].add(weights, mode="drop")
    # Experts as the batch axis of both matmuls: the weights are read in their own layout
    # (a "th,ehf" contraction made XLA:CPU relayout them: 3x slower at 8 tokens).
    rows = jnp.broadcast_to(x[None], (G, T, H))
    h = jnp.einsum("eth,ehf->etf", rows, gate_up, precision=precision)
    if gate_up_bias is not None:
        h = h + gate_up_bias[:, None]
    h = expert_activation(h, cfg).astype(x.dtype)
    y = jnp.einsum("eti,eih->eth", h, down, precision=precision)
    if down_bias is not None:
        y = y + down_bias[:, None]
    return jnp.einsum("eth,te->th", y.astype(jnp.float32), dense, precision=precision).astype(x.dtype)


MOE_PATHS = {"grouped": moe_ragged, "gathered": moe_gathered}


def moe_expert_parallel(x, weights, experts, gate_up, down, cfg: MoEConfig, mesh, *biases, path=moe_ragged):
    """``moe_ragged`` with the experts split over the mesh's tensor-parallel axis.

    Each device holds ``E / tp`` whole experts and, as between all layers here, every
    token (activations are replicated). It runs its own experts on the assignments routed
    to them, and one all-reduce of ``[T, H]`` sums the devices' parts: what the dense MLP's
    row-parallel projection moves, ``2 (tp - 1) / tp * H * b`` bytes per token and device
    (ring), whatever ``top_k``. The other choice, an all-to-all sending each token to the
    devices of its experts and back, moves ``2 * k * H * b`` per token (less the
    assignments that stay local) and pays off only when tokens are split over the devices
    first (data-parallel attention), which this stack does not do."""
    tp = mesh.shape[AXIS]
    local = cfg.num_experts // tp

    def shard(x, weights, experts, gate_up, down, *biases):
        first = jax.lax.axis_index(AXIS) * local
        mine = (experts >= first) & (experts < first + local)
        here = jnp.where(mine, experts - first, local)
        out = path(x, weights, here, gate_up, down, cfg, *biases, groups=local)
        return jax.lax.psum(out, AXIS)

    split = P(AXIS)
    specs = (P(), P(), P(), split, split) + (split,) * len(biases)
    run = jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    return run(x, weights, experts, gate_up, down, *biases)


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
    """Router + experts (+ a shared expert); ``__call__`` takes ``[..., H]`` and returns the
    same shape. With a ``mesh`` the experts are split over its tensor-parallel axis
    (``moe_expert_parallel``)."""

    def __init__(
        self,
        hidden: int,
        cfg: MoEConfig,
        *,
        dtype,
        rngs: nnx.Rngs,
        mesh=None,
        path: str = "grouped",
        hash_vocab: int = 0,
    ):
        self.cfg = cfg
        self.mesh = mesh
        self.path = path  # MOE_PATHS: "grouped" (ragged_dot) or "gathered" (CPU)
        E, I = cfg.num_experts, cfg.intermediate
        up = 2 * I if cfg.gated else I
        self.router = Linear(hidden, E, bias=cfg.router_bias, dtype=dtype, rngs=rngs)
        biased = cfg.router in ("sigmoid_topk", "sqrtsoftplus_topk") and not hash_vocab
        self.score_correction_bias = nnx.Param(jnp.zeros((E,), dtype)) if biased else None
        # ``hash_vocab``: experts chosen by token id, ``tid2eid [vocab, k]`` (DeepSeek V4).
        self.tid2eid = nnx.Param(jnp.zeros((hash_vocab, cfg.top_k), jnp.int32)) if hash_vocab else None
        normal = lambda shape, fan_in: (jax.random.normal(rngs.params(), shape) * fan_in**-0.5).astype(dtype)  # noqa: E731
        self.gate_up = nnx.Param(normal((E, hidden, up), hidden))
        self.down = nnx.Param(normal((E, I, hidden), I))
        self.gate_up_bias = nnx.Param(jnp.zeros((E, up), dtype)) if cfg.expert_bias else None
        self.down_bias = nnx.Param(jnp.zeros((E, hidden), dtype)) if cfg.expert_bias else None
        if cfg.shared_intermediate:
            width, act = cfg.shared_intermediate, cfg.activation
            limit = None
            if act == "silu_clamped":
                act, limit = "silu", cfg.swiglu_limit
            self.shared_expert = MLP(
                hidden, width, activation=act, gated=cfg.gated, dtype=dtype, rngs=rngs, limit=limit
            )
        else:
            self.shared_expert = None
        if cfg.shared_gate:
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype, rngs=rngs)
        else:
            self.shared_expert_gate = None

    def biases(self) -> tuple:
        if self.gate_up_bias is None:
            return ()
        return self.gate_up_bias[...], self.down_bias[...]

    @jax.named_scope("moe")
    def __call__(self, x: jax.Array, *, reference: bool = False, ids: jax.Array | None = None) -> jax.Array:
        """``ids``: the tokens' ids, which choose the experts of a hash layer."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        correction = None if self.score_correction_bias is None else self.score_correction_bias[...]
        chosen = None if self.tid2eid is None else self.tid2eid[...][ids.reshape(-1)]
        weights, experts = route(self.router(x2), self.cfg, correction, chosen)
        args = (x2, weights, experts, self.gate_up[...], self.down[...], self.cfg)
        if reference:
            out = moe_dense_reference(*args, *self.biases())
        elif self.mesh is not None and self.mesh.shape[AXIS] > 1:
            out = moe_expert_parallel(*args, self.mesh, *self.biases(), path=MOE_PATHS[self.path])
        else:
            out = MOE_PATHS[self.path](*args, *self.biases())
        if self.shared_expert is not None:
            shared = self.shared_expert(x2)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x2)) * shared
            out = out + shared
        return out.reshape(shape)
