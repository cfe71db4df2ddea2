"""Float32 logits equal transformers' on the same inputs, for every supported family.

Tolerance: 2e-5 of the largest |logit|. Both sides compute in float32 but sum in different
orders (blocked online softmax vs dense softmax, chunked SSD scan vs torch's), which moves
the last few bits; on these checkpoints the observed error is 1e-6..4e-6 relative. Wrong
layouts, norms or masks give errors of 1e-2 and more.
"""

import json
import math
import os

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from hicache_jax.models import load_hf
from hicache_jax.models.presets import build_preset
from hicache_jax.models.registry import config_from_hf
from tests.hf_checkpoints import load_reference

# 70 tokens: more than three sliding windows (20) and four Bamba SSD chunks (16);
# the GQA ratio is 2 for Mistral/Bamba and 4 for Gemma3/Llama.
LENGTH = 70


FAMILIES = [
    "mistral",
    "gemma3",
    "bamba",
    "llama",
    "qwen3",
    "qwen3_moe",
    "olmo3",
    "gpt_oss",
    "nemotron_h",
    "nemotron_h_moe",
    "granite_h",
    "granite_h_moe",
    "qwen3_5",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "deepseek_v4",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoint_dir, family):
    path = checkpoint_dir(family)
    ids = np.random.RandomState(0).randint(0, 512, size=(2, LENGTH))
    with torch.no_grad():
        want = load_reference(path)(torch.tensor(ids)).logits.numpy()
    got = np.asarray(jax.jit(load_hf(path).forward_full)(ids))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)


def test_model_config_reads_architecture_details(checkpoint_dir):
    gemma = load_hf(checkpoint_dir("gemma3")).cfg
    assert gemma.layer_kinds == ("sliding", "attention", "sliding", "attention")
    assert gemma.rope_base("sliding") == 1e4 and gemma.rope_base("attention") == 1e6
    assert gemma.num_heads // gemma.num_kv_heads == 4
    bamba = load_hf(checkpoint_dir("bamba")).cfg
    assert bamba.layer_kinds == ("mamba", "attention", "mamba")
    assert bamba.rotary_dim == bamba.head_dim // 2
    mistral = load_hf(checkpoint_dir("mistral")).cfg
    assert mistral.layer_kinds == ("sliding", "sliding") and mistral.sliding_window == 20
    qwen3 = load_hf(checkpoint_dir("qwen3")).cfg
    assert qwen3.layer_kinds == ("attention", "sliding") and qwen3.sliding_window == 20 and qwen3.qk_norm
    moe = load_hf(checkpoint_dir("qwen3_moe")).cfg
    assert moe.layer_kinds == ("sliding",) * 3 and moe.sparse_layers == (0, 2)  # mlp_only_layers=[1]
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.norm_topk_prob) == (8, 2, True)
    olmo = load_hf(checkpoint_dir("olmo3")).cfg
    assert olmo.layer_kinds == ("sliding",) * 3 + ("attention",) and not olmo.pre_norms
    assert olmo.yarn("attention").factor == 8.0 and olmo.yarn("sliding") is None
    qwen35 = load_hf(checkpoint_dir("qwen3_5"))
    c = qwen35.cfg
    assert c.layer_kinds == ("gdn", "attention", "gdn", "gdn") and c.attention_output_gate
    assert c.rotary_dim == 4 and c.norm_offset == 1.0 and c.qk_norm
    assert (c.gdn.num_k_heads, c.gdn.num_v_heads, c.gdn.head_k_dim, c.gdn.head_v_dim) == (4, 8, 16, 8)
    nxt = load_hf(checkpoint_dir("qwen3_next")).cfg
    assert nxt.layer_kinds == c.layer_kinds and nxt.sparse_layers == (0, 1, 3)  # mlp_only_layers=[2]
    assert (nxt.moe.shared_intermediate, nxt.moe.shared_gate, nxt.moe.norm_topk_prob) == (48, True, True)
    moe35 = load_hf(checkpoint_dir("qwen3_5_moe")).cfg
    assert moe35.sparse_layers == (0, 1, 2, 3) and moe35.moe == nxt.moe


def _stack_experts(tensors: dict) -> dict:
    """Per-expert MoE tensors -> transformers 5's stacked ``experts.gate_up_proj [E, 2I, H]``
    (gate rows, then up) and ``experts.down_proj [E, H, I]``."""
    out, experts = {}, {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(int(e), {})[proj] = t
    for head, by_e in experts.items():
        es = [by_e[e] for e in sorted(by_e)]
        out[f"{head}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([x["gate_proj"], x["up_proj"]]) for x in es]
        )
        out[f"{head}.mlp.experts.down_proj"] = np.stack([x["down_proj"] for x in es])
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_multimodal_checkpoint_reads_its_text_model(checkpoint_dir, tmp_path, family):
    """The published Qwen3.5 checkpoints are ``Qwen3_5[Moe]ForConditionalGeneration``: the
    text model's config nested under ``text_config`` and its weights under
    ``model.language_model`` (MoE experts here in transformers 5's stacked tensors). The
    same weights, so laid out, give the same logits."""
    from safetensors.numpy import load_file, save_file

    src = checkpoint_dir(family)
    hf = json.load(open(os.path.join(src, "config.json")))
    text = {k: v for k, v in hf.items() if k not in ("architectures", "tie_word_embeddings")}
    arch = hf["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")
    nested = {"architectures": [arch], "text_config": text, "tie_word_embeddings": hf["tie_word_embeddings"]}
    json.dump(nested, open(tmp_path / "config.json", "w"))
    tensors = _stack_experts(load_file(os.path.join(src, "model.safetensors")))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.merger.weight"] = np.zeros((2, 2), np.float32)  # a vision tensor, unread
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids = np.random.RandomState(3).randint(0, 512, size=(1, 20))
    want = np.asarray(jax.jit(load_hf(src).forward_full)(ids))
    model = load_hf(str(tmp_path))
    assert model.cfg.architecture == arch
    np.testing.assert_array_equal(np.asarray(jax.jit(model.forward_full)(ids)), want)


def test_hybrid_layouts_map_onto_our_layers(checkpoint_dir):
    """Nemotron-H's blocks paired into our layers ("M*-MM-*": a lone Mamba, attention with an
    MLP, a lone Mamba, a Mamba with an MLP, a lone attention); Granite's multipliers."""
    nemotron = load_hf(checkpoint_dir("nemotron_h")).cfg
    assert nemotron.layer_kinds == ("mamba", "attention", "mamba", "mamba", "attention")
    assert nemotron.mlp_free_layers == (0, 2, 4) and not nemotron.rope and not nemotron.mlp_gated
    # Published configs give the blocks as a pattern string, transformers 5 writes a list.
    hf = json.load(open(os.path.join(checkpoint_dir("nemotron_h"), "config.json")))
    letter = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    assert "".join(letter[b] for b in hf.pop("layers_block_type")) == "M*-MM-*"
    assert config_from_hf(hf | {"hybrid_override_pattern": "M*-MM-*"}) == nemotron
    assert (nemotron.mamba.dt_min, nemotron.mamba.dt_max) == (0.3, 2.0)  # time_step_limit
    moe = load_hf(checkpoint_dir("nemotron_h_moe")).cfg  # "ME*EMM-"
    assert moe.sparse_layers == (0, 1) and moe.mlp_free_layers == (2,)
    assert (moe.moe.router, moe.moe.num_groups, moe.moe.routed_scaling) == ("sigmoid_topk", 2, 2.5)
    granite = load_hf(checkpoint_dir("granite_h")).cfg
    assert granite.rope and granite.moe is None and granite.intermediate_size == 128
    assert (granite.embed_scale, granite.attn_scale, granite.residual_multiplier) == (6.0, 0.2, 0.5)
    assert granite.logits_scaling == 4.0
    granite_moe = load_hf(checkpoint_dir("granite_h_moe")).cfg
    assert not granite_moe.rope and granite_moe.sparse_layers == (0, 1, 2, 3)
    assert granite_moe.moe.shared_intermediate == 48 and granite_moe.moe.router == "topk_softmax"


@pytest.mark.parametrize(
    "family",
    [
        "nemotron_h_moe",
        "granite_h_moe",
        "gpt_oss",
        "gemma3",
        "qwen3_5",
        "qwen3_next",
        "qwen3_5_moe",
        "deepseek_v3",
        "glm_moe_dsa",
        "deepseek_v4",
    ],
)
def test_param_count_is_the_models(checkpoint_dir, family):
    """``ModelConfig.num_params`` counts the parameters the model holds (MLP-free layers,
    ungated MLPs, shared experts, correction biases, sinks, sandwich norms)."""
    model = load_hf(checkpoint_dir(family))
    held = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    assert model.cfg.num_params() == held


PRESETS = [
    "tiny-mamba",
    "tiny-gpt-oss",
    "tiny-nemotron-h",
    "tiny-granite-h",
    "tiny-qwen3.5",
    "100m-gdn",
    "tiny-qwen3-next",
    "tiny-mla",
    "tiny-dsa",
    "tiny-dsv4",
    "100m-dsv4",
]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_param_count_is_the_models(preset):
    model = build_preset(preset)
    held = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    assert model.cfg.num_params() == held


def test_deepseek_configs_read_latent_attention(checkpoint_dir):
    """MLA and DSA fields, DeepSeek's YaRN mscale on the softmax and the MoE layout (no
    multi-token-prediction block: ``test_mtp_families.py`` adds them)."""
    v3 = load_hf(checkpoint_dir("deepseek_v3")).cfg
    assert v3.nextn is None
    assert v3.layer_kinds == ("mla",) * 3 and v3.sparse_layers == (1, 2)
    assert v3.mla.q_lora_rank == 0 and v3.mla.rope_interleave and not v3.mla.index_n_heads
    mscale = 0.1 * 0.8 * math.log(4.0) + 1  # mscale_all_dim 0.8, factor 4
    assert v3.mla.softmax_scale == pytest.approx(24**-0.5 * mscale**2)
    assert v3.moe.router == "sigmoid_topk" and (v3.moe.num_groups, v3.moe.topk_groups) == (2, 1)
    assert v3.moe.shared_intermediate == 32 and v3.moe.routed_scaling == 2.5
    glm = load_hf(checkpoint_dir("glm_moe_dsa")).cfg
    assert glm.layer_kinds == ("dsa", "dsa_shared", "dsa")
    assert glm.mla.index_rope_interleave and glm.mla.index_topk == 128
    v32 = load_hf(checkpoint_dir("deepseek_v32")).cfg
    assert v32.layer_kinds == ("dsa",) * 3 and not v32.mla.index_rope_interleave
