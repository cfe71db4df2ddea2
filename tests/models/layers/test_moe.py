"""The MoE layer: the grouped (ragged) path against the dense definition over generated
routings, and each family's router and experts against transformers' own modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.models.layers.moe import MoE, MoEConfig, moe_dense_reference, moe_gathered, moe_ragged, route


@st.composite
def cases(draw):
    E = draw(st.integers(1, 8))
    cfg = MoEConfig(
        num_experts=E,
        top_k=draw(st.integers(1, E)),
        intermediate=8,
        router=draw(st.sampled_from(["softmax_topk", "topk_softmax"])),
        norm_topk_prob=draw(st.booleans()),
        expert_bias=draw(st.booleans()),
        activation=draw(st.sampled_from(["silu", "swiglu_clamped"])),
    )
    T = draw(st.sampled_from([1, 7, 24]))
    skew = draw(st.sampled_from([0.0, 50.0]))  # 50: nearly every token prefers expert 0
    return cfg, T, skew, draw(st.integers(0, 2**16))


_ragged = jax.jit(moe_ragged, static_argnames="cfg")
_gathered = jax.jit(moe_gathered, static_argnames="cfg")
_dense = jax.jit(moe_dense_reference, static_argnames="cfg")


@settings(max_examples=10, deadline=None)
@given(cases())
def test_grouped_and_gathered_experts_equal_the_dense_definition(case):
    cfg, T, skew, seed = case
    H = 16
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(ks[0], (T, H))
    logits = jax.random.normal(ks[1], (T, cfg.num_experts)).at[:, 0].add(skew)
    gate_up = jax.random.normal(ks[2], (cfg.num_experts, H, 2 * cfg.intermediate)) * 0.5
    down = jax.random.normal(ks[3], (cfg.num_experts, cfg.intermediate, H)) * 0.5
    biases = (None, None)
    if cfg.expert_bias:
        biases = (
            jax.random.normal(ks[4], (cfg.num_experts, 2 * cfg.intermediate)),
            jax.random.normal(ks[5], (cfg.num_experts, H)),
        )
    weights, experts = route(logits, cfg)
    assert experts.shape == (T, cfg.top_k) and weights.shape == (T, cfg.top_k)
    if cfg.router == "topk_softmax" or cfg.norm_topk_prob:
        np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-5)
    args = (x, weights, experts, gate_up, down)
    kw = dict(cfg=cfg, gate_up_bias=biases[0], down_bias=biases[1])
    want = _dense(*args, **kw)
    # The grouped path (ragged_dot) and CPU's gathered one: each assignment's expert
    # gathered (T * top_k < experts) or every expert on every token (otherwise).
    for path in (_ragged, _gathered):
        np.testing.assert_allclose(np.asarray(path(*args, **kw)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_expert_count_that_cannot_route_is_refused():
    with pytest.raises(ValueError, match="top_k=3: must be in \\[1, num_experts=2\\]"):
        MoEConfig(num_experts=2, top_k=3, intermediate=4)
    with pytest.raises(ValueError, match="router='sigmoid'"):
        MoEConfig(num_experts=2, top_k=1, intermediate=4, router="sigmoid")


def _call(layer, x, reference=False):
    """The layer under one jit (op by op, each of its ops compiled alone: slower, and one
    such compile once crashed XLA:CPU in a loaded worker)."""
    return nnx.jit(lambda layer, x: layer(x, reference=reference))(layer, x)


def _ours(
    cfg: MoEConfig, H: int, router_w, router_b, gate_up, down, gate_up_bias=None, down_bias=None
) -> MoE:
    layer = MoE(H, cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer.router.kernel[...] = jnp.asarray(router_w.T)
    if router_b is not None:
        layer.router.bias[...] = jnp.asarray(router_b)
    layer.gate_up[...] = jnp.asarray(gate_up)
    layer.down[...] = jnp.asarray(down)
    if gate_up_bias is not None:
        layer.gate_up_bias[...] = jnp.asarray(gate_up_bias)
        layer.down_bias[...] = jnp.asarray(down_bias)
    return layer


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_matches_transformers(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    H, I, E, k = 32, 16, 8, 2
    tc = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
        num_experts_per_tok=k,
        norm_topk_prob=norm_topk_prob,
    )
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(tc).float()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 11, H)
    with torch.no_grad():
        want = block(x).numpy()
    cfg = MoEConfig(
        num_experts=E, top_k=k, intermediate=I, router="softmax_topk", norm_topk_prob=norm_topk_prob
    )
    ours = _ours(
        cfg,
        H,
        block.gate.weight.detach().numpy(),
        None,
        block.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1),  # [E, 2I, H] -> [E, H, 2I]
        block.experts.down_proj.detach().numpy().transpose(0, 2, 1),  # [E, H, I] -> [E, I, H]
    )
    got = np.asarray(_call(ours, jnp.asarray(x.numpy())))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(_call(ours, jnp.asarray(x.numpy()), reference=True)), want, rtol=1e-5, atol=1e-5
    )


def test_gpt_oss_mlp_matches_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    H, I, E, k = 32, 16, 8, 4
    tc = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    torch.manual_seed(0)
    mlp = GptOssMLP(tc).float()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) * 0.5)  # wide enough that the swiglu clamps bite
    x = torch.randn(2, 9, H) * 3
    with torch.no_grad():
        want = mlp(x)[0].numpy()
    cfg = MoEConfig(
        num_experts=E,
        top_k=k,
        intermediate=I,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="swiglu_clamped",
        swiglu_alpha=tc.swiglu_alpha,
        swiglu_limit=tc.swiglu_limit,
    )
    gu = mlp.experts.gate_up_proj.detach().numpy()  # [E, H, 2I], gate and up interleaved
    gub = mlp.experts.gate_up_proj_bias.detach().numpy()
    ours = _ours(
        cfg,
        H,
        mlp.router.weight.detach().numpy(),
        mlp.router.bias.detach().numpy(),
        np.concatenate([gu[..., ::2], gu[..., 1::2]], axis=-1),
        mlp.experts.down_proj.detach().numpy(),
        np.concatenate([gub[..., ::2], gub[..., 1::2]], axis=-1),
        mlp.experts.down_proj_bias.detach().numpy(),
    )
    xs = jnp.asarray(x.numpy())
    got = np.asarray(_call(ours, xs))
    # The clamps are active: some gate pre-activations exceed the limit.
    gate = np.einsum("th,ehf->tef", x.reshape(-1, H).numpy(), gu[..., ::2]) + gub[None, :, ::2]
    assert (gate > tc.swiglu_limit).any()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
