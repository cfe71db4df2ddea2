"""The MoE layer: the grouped (ragged) path against the dense definition over generated
routings, and each family's router and experts (and shared expert) against transformers'
own modules."""

from __future__ import annotations

import dataclasses

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
        router=draw(st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid_topk"])),
        norm_topk_prob=draw(st.booleans()),
        expert_bias=draw(st.booleans()),
        activation=draw(st.sampled_from(["silu", "swiglu_clamped", "relu2"])),
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
    up = (2 if cfg.gated else 1) * cfg.intermediate  # relu2 experts: up alone
    gate_up = jax.random.normal(ks[2], (cfg.num_experts, H, up)) * 0.5
    down = jax.random.normal(ks[3], (cfg.num_experts, cfg.intermediate, H)) * 0.5
    biases = (None, None)
    if cfg.expert_bias:
        biases = (
            jax.random.normal(ks[4], (cfg.num_experts, up)),
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
    with pytest.raises(ValueError, match="shared_gate without a shared expert"):
        MoEConfig(num_experts=2, top_k=1, intermediate=4, shared_gate=True)
    with pytest.raises(ValueError, match="num_groups=3: must divide num_experts=8"):
        MoEConfig(num_experts=8, top_k=1, intermediate=4, router="sigmoid_topk", num_groups=3)
    with pytest.raises(ValueError, match="top_k=5: more than the experts of topk_groups=1"):
        MoEConfig(num_experts=8, top_k=5, intermediate=4, router="sigmoid_topk", num_groups=2)


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


def _load_mlp(ours, theirs, gated: bool = True):
    """A dense MLP's weights (torch ``{gate,up,down}_proj``) into ours."""
    for name in ("gate_proj", "up_proj", "down_proj") if gated else ("up_proj", "down_proj"):
        getattr(ours, name).kernel[...] = jnp.asarray(getattr(theirs, name).weight.detach().numpy().T)


def _randomize(module, scale: float):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)


def test_qwen3_next_gated_shared_expert_matches_transformers():
    """The shared expert, its output gated by sigmoid(Linear(hidden -> 1)), beside softmax
    top-k experts: Qwen3-Next's sparse MoE block."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    H, I, S, E, k = 32, 16, 24, 8, 2
    tc = Qwen3NextConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=S,
        num_experts=E,
        num_experts_per_tok=k,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    block = Qwen3NextSparseMoeBlock(tc).float()
    _randomize(block, 0.3)
    x = torch.randn(2, 11, H)
    with torch.no_grad():
        want = block(x).numpy()
    cfg = MoEConfig(
        num_experts=E, top_k=k, intermediate=I, norm_topk_prob=True, shared_intermediate=S, shared_gate=True
    )
    ours = _ours(
        cfg,
        H,
        block.gate.weight.detach().numpy(),
        None,
        block.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1),
        block.experts.down_proj.detach().numpy().transpose(0, 2, 1),
    )
    _load_mlp(ours.shared_expert, block.shared_expert)
    ours.shared_expert_gate.kernel[...] = jnp.asarray(block.shared_expert_gate.weight.detach().numpy().T)
    xs = jnp.asarray(x.numpy())
    np.testing.assert_allclose(np.asarray(_call(ours, xs)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_call(ours, xs, reference=True)), want, rtol=1e-5, atol=1e-5)
    # The gate matters: without it the output is another.
    ungated = MoEConfig(num_experts=E, top_k=k, intermediate=I, norm_topk_prob=True, shared_intermediate=S)
    plain = _ours(ungated, H, block.gate.weight.detach().numpy(), None, ours.gate_up[...], ours.down[...])
    _load_mlp(plain.shared_expert, block.shared_expert)
    assert np.abs(np.asarray(_call(plain, xs)) - want).max() > 1e-2


def test_nemotron_h_moe_matches_transformers():
    """Sigmoid scores with a correction bias on the choice, the best of two expert groups,
    renormalised and scaled weights, squared-ReLU experts without a gate, and an ungated
    shared expert."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    H, I, S, E, k = 32, 16, 24, 8, 2
    tc = NemotronHConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        moe_shared_expert_intermediate_size=S,
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    block = NemotronHMoE(tc).float()
    _randomize(block, 0.3)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.2)
    x = torch.randn(2, 11, H)
    with torch.no_grad():
        want = block(x).numpy()
    cfg = MoEConfig(
        num_experts=E,
        top_k=k,
        intermediate=I,
        router="sigmoid_topk",
        norm_topk_prob=True,
        activation="relu2",
        num_groups=2,
        topk_groups=1,
        routed_scaling=2.5,
        shared_intermediate=S,
    )
    ours = _ours(
        cfg,
        H,
        block.gate.weight.detach().numpy(),
        None,
        block.experts.up_proj.detach().numpy().transpose(0, 2, 1),  # [E, I, H] -> [E, H, I]
        block.experts.down_proj.detach().numpy().transpose(0, 2, 1),
    )
    ours.score_correction_bias[...] = jnp.asarray(block.gate.e_score_correction_bias.numpy())
    _load_mlp(ours.shared_expert, block.shared_experts, gated=False)
    xs = jnp.asarray(x.numpy())
    np.testing.assert_allclose(np.asarray(_call(ours, xs)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_call(ours, xs, reference=True)), want, rtol=1e-5, atol=1e-5)
    # The correction bias and the group limit both change which experts run.
    logits = jnp.asarray(x.reshape(-1, H).numpy() @ block.gate.weight.detach().numpy().T)
    chosen = np.sort(np.asarray(route(logits, cfg, ours.score_correction_bias[...])[1]), -1)
    unbiased = np.sort(np.asarray(route(logits, cfg)[1]), -1)
    ungrouped = dataclasses.replace(cfg, num_groups=1, topk_groups=1)
    free = np.sort(np.asarray(route(logits, ungrouped, ours.score_correction_bias[...])[1]), -1)
    assert (chosen != unbiased).any() and (chosen != free).any()


def test_granite_moe_and_shared_mlp_match_transformers():
    """Granite 4.0-H's MLP half: top-k router logits then softmax, fused ``[gate; up]``
    experts, and the shared MLP's output added."""
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMLP,
        GraniteMoeHybridMoE,
    )

    H, I, S, E, k = 32, 16, 24, 8, 2
    tc = GraniteMoeHybridConfig(
        hidden_size=H,
        intermediate_size=I,
        shared_intermediate_size=S,
        num_local_experts=E,
        num_experts_per_tok=k,
        mamba_n_heads=8,  # (unused here; the config checks it divides the Mamba width)
    )
    torch.manual_seed(0)
    moe, shared = GraniteMoeHybridMoE(tc).float(), GraniteMoeHybridMLP(tc).float()
    _randomize(moe, 0.3)
    _randomize(shared, 0.3)
    x = torch.randn(2, 11, H)
    with torch.no_grad():
        want = (moe(x) + shared(x)).numpy()
    cfg = MoEConfig(num_experts=E, top_k=k, intermediate=I, router="topk_softmax", shared_intermediate=S)
    ours = _ours(
        cfg,
        H,
        moe.router.weight.detach().numpy(),
        None,
        moe.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1),  # [E, 2I, H], gate rows first
        moe.experts.down_proj.detach().numpy().transpose(0, 2, 1),
    )
    fused = shared.input_linear.weight.detach().numpy()  # [2S, H]: gate rows, then up
    ours.shared_expert.gate_proj.kernel[...] = jnp.asarray(fused[:S].T)
    ours.shared_expert.up_proj.kernel[...] = jnp.asarray(fused[S:].T)
    ours.shared_expert.down_proj.kernel[...] = jnp.asarray(shared.output_linear.weight.detach().numpy().T)
    np.testing.assert_allclose(np.asarray(_call(ours, jnp.asarray(x.numpy()))), want, rtol=1e-5, atol=1e-5)
