"""Tiny random-weight Hugging Face checkpoints made with ``transformers`` (``save_pretrained``).

Weights are drawn wide enough (unit-scale activations, norm scales away from 1, Mamba
A/dt/D spread out) that a wrong layout or a missed term shows up in the logits.
"""

from __future__ import annotations

import math

FAMILIES = ("mistral", "gemma3", "bamba", "llama")
PAGE = 16  # page size the tests use; the window is one page and a bit


def hf_config(family: str, **overrides):
    """The family's tiny config; ``overrides`` replace its fields (e.g. more heads)."""

    cfg = _hf_config(family)
    for name, value in overrides.items():
        if not hasattr(cfg, name):
            raise ValueError(f"{family}: no config field {name!r}")
        setattr(cfg, name, value)
    return cfg


def _hf_config(family: str):
    import transformers as tf

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    if family == "mistral":
        return tf.MistralConfig(**common, num_hidden_layers=2, head_dim=16, sliding_window=20)
    if family == "llama":
        return tf.LlamaConfig(**(common | {"num_key_value_heads": 1}), num_hidden_layers=2, head_dim=16)
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **(common | {"num_key_value_heads": 1}),
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=20,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
        )
    if family == "qwen3":  # a full-attention layer, then a sliding one
        return tf.Qwen3Config(
            **common,
            num_hidden_layers=2,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=20,
            max_window_layers=1,
        )
    if family == "qwen3_moe":  # MoE layers around a dense one; every layer sliding
        return tf.Qwen3MoeConfig(
            **common,
            num_hidden_layers=3,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=20,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    if family == "olmo3":  # three sliding layers, then a full one with YaRN
        return tf.Olmo3Config(
            **common,
            num_hidden_layers=4,
            sliding_window=20,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,  # YaRN's blend within the test's 70 tokens
                    "attention_factor": 1.2,
                    "beta_fast": 32,
                    "beta_slow": 1,
                },
            },
            eos_token_id=2,
            pad_token_id=1,
        )
    if family == "gpt_oss":  # sliding and full layers alternating, YaRN active within 70 tokens
        return tf.GptOssConfig(
            **(common | {"intermediate_size": 32}),
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=20,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            eos_token_id=2,
            pad_token_id=1,
        )
    if family == "qwen3_5":  # GDN layers around a gated full-attention one
        return tf.Qwen3_5TextConfig(**common, **_gdn_common())
    # Qwen3-Next's MoE: softmax top-k of 8 experts beside a sigmoid-gated shared expert.
    moe = dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    )
    if family == "qwen3_next":  # fused GDN projections; a dense MLP in one GDN layer
        return tf.Qwen3NextConfig(**common, **_gdn_common(), **moe, norm_topk_prob=True, mlp_only_layers=[2])
    if family == "qwen3_5_moe":  # MoE in every layer
        dense = {k: v for k, v in common.items() if k != "intermediate_size"}
        return tf.Qwen3_5MoeTextConfig(**dense, **_gdn_common(), **moe)
    nemotron = dict(
        **common,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        time_step_limit=(0.3, 2.0),  # both the floor and the ceiling bind for some tokens
        eos_token_id=2,
        pad_token_id=1,
    )
    if family == "nemotron_h":  # lone mixers (an "MM" pair, a last one), attention with an MLP
        return tf.NemotronHConfig(**nemotron, hybrid_override_pattern="M*-MM-*")
    if family == "nemotron_h_moe":  # MoE after a Mamba and an attention block; groups and scaling
        return tf.NemotronHConfig(
            **nemotron,
            hybrid_override_pattern="ME*EMM-",
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        )
    granite = dict(
        **common,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        embedding_multiplier=6.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=4.0,
        eos_token_id=2,
        pad_token_id=1,
    )
    if family == "granite_h":  # dense (the shared MLP alone), RoPE
        return tf.GraniteMoeHybridConfig(
            **(granite | {"intermediate_size": 32}),
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            position_embedding_type="rope",
            num_local_experts=0,
            shared_intermediate_size=128,
        )
    if family == "granite_h_moe":  # experts beside the shared MLP, no position encoding
        return tf.GraniteMoeHybridConfig(
            **(granite | {"intermediate_size": 32}),
            num_hidden_layers=4,
            layer_types=["attention", "mamba", "mamba", "attention"],
            position_embedding_type="nope",
            num_local_experts=8,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
        )
    if family in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        return _deepseek(family, common)
    if family == "deepseek_v4":
        return _deepseek_v4(common)
    if family == "bamba":
        return tf.BambaConfig(
            **common,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_chunk_size=16,
            mamba_d_conv=4,
        )
    raise ValueError(family)


def _deepseek(family: str, common: dict):
    """MLA (V3: queries without the low-rank step, YaRN with mscale), or MLA with an
    indexer whose top-k covers every position (V3.2; GLM-5 with a layer sharing the previous
    layer's picks); a dense MLP, then MoE layers with grouped routing and a shared expert."""
    import transformers as tf

    mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32)
    moe = dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    )
    base = common | {"num_key_value_heads": 4} | mla | moe
    if family == "deepseek_v3":
        yarn = dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=128,
            mscale=1.0,
            mscale_all_dim=0.8,
        )
        v3 = base | {"q_lora_rank": None, "max_position_embeddings": 512}
        # No MTP layer: save_pretrained writes none (tests/models/test_mtp_families.py adds one).
        return tf.DeepseekV3Config(
            **v3, num_hidden_layers=3, rope_parameters=yarn, num_nextn_predict_layers=0
        )
    indexer = dict(index_n_heads=4, index_head_dim=16, index_topk=128)
    if family == "deepseek_v32":
        return tf.DeepseekV32Config(**base, **indexer, num_hidden_layers=3)
    return tf.GlmMoeDsaConfig(
        **base, **indexer, num_hidden_layers=3, indexer_types=["full", "shared", "full"]
    )


def _deepseek_v4(common: dict, **overrides):
    """Every DeepSeek V4 layer kind once (sliding, CSA at 4 tokens an entry, HCA at 16: one
    page), a hash-routed MoE layer then top-k ones, two residual streams, YaRN on the
    compressed layers; ``index_topk`` covers every entry up to 512 tokens (transformers is
    self-consistent only then). Three layers: a fourth (a second CSA) covered no other kind,
    and every V4 test compiled and ran it."""
    import transformers as tf

    v4 = dict(
        vocab_size=common["vocab_size"],
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=24,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": PAGE},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        sliding_window=20,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=128,
        hc_mult=2,
        partial_rotary_factor=8 / 32,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
        max_position_embeddings=4096,
        num_nextn_predict_layers=0,
        eos_token_id=2,
    )
    return tf.DeepseekV4Config(**(v4 | overrides))


def _gdn_common() -> dict:
    """Qwen3-Next / Qwen3.5 layers: 4 key heads (so tp 4 splits them) each shared by 2 value
    heads, key and value head dims apart (16, 8) so a swapped axis shows."""
    return dict(
        num_hidden_layers=4,
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        eos_token_id=2,
        pad_token_id=1,
    )


def randomize(model, seed: int = 0) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    kind = type(model).__name__.lower()
    zero_centered = any(f in kind for f in ("gemma", "qwen3_5", "qwen3next"))  # norms scale by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") and "linear_attn" in name:  # GDN: slow and fast decays
                p.copy_(torch.log(torch.rand(p.shape, generator=g) + 0.01))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1.0)
            elif name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                base = 0.0 if zero_centered and "linear_attn.norm" not in name else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if "conv1d" not in name else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # Nemotron-H's router: shifts the choice
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            if name.endswith("tid2eid"):  # DeepSeek V4's hash routing: distinct experts per token
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))


def hf_model(family: str, seed: int = 0, **overrides):
    import torch
    import transformers as tf

    cfg = hf_config(family, **overrides)
    cls = {
        "mistral": tf.MistralForCausalLM,
        "llama": tf.LlamaForCausalLM,
        "gemma3": tf.Gemma3ForCausalLM,
        "bamba": tf.BambaForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "olmo3": tf.Olmo3ForCausalLM,
        "gpt_oss": tf.GptOssForCausalLM,
        "qwen3_5": tf.Qwen3_5ForCausalLM,
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
        "nemotron_h": tf.NemotronHForCausalLM,
        "nemotron_h_moe": tf.NemotronHForCausalLM,
        "granite_h": tf.GraniteMoeHybridForCausalLM,
        "granite_h_moe": tf.GraniteMoeHybridForCausalLM,
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
        "deepseek_v32": tf.DeepseekV32ForCausalLM,
        "glm_moe_dsa": tf.GlmMoeDsaForCausalLM,
        "deepseek_v4": tf.DeepseekV4ForCausalLM,
    }[family]
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    randomize(model, seed)
    return model


def make(family: str, out_dir: str, seed: int = 0, overrides: dict | None = None, **save_kwargs) -> str:
    hf_model(family, seed, **(overrides or {})).save_pretrained(out_dir, **save_kwargs)
    return out_dir


def load_reference(model_dir: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
