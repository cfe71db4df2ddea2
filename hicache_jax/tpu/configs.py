"""``config.json`` fields of published models, for compiling and planning without weights.

Each is the subset the config readers (``models/hf/config.py``) use, with the published
values. ``real_config(name, num_layers=k)`` keeps ``k`` layers (more if the model has more kinds):
the first ones, with the last of a repeated kind swapped for each kind they lack, for
compile tests at real widths and bounded depth.
"""

from __future__ import annotations

import dataclasses

from hicache_jax.models.config import ModelConfig
from hicache_jax.models.registry import config_from_hf

HF_CONFIGS: dict[str, dict] = {
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "sliding_window": 4096,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
    },
    "gemma-3-4b": {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262208,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
    },
    "gemma-3-27b": {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "vocab_size": 262208,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
    },
    "bamba-9b": {
        "architectures": ["BambaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "attn_layer_indices": [9, 18, 27],
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
    },
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "attention_bias": True,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "rope_theta": 150000.0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0,
    },
    "olmo-3-7b": {
        "architectures": ["Olmo3ForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 100278,
        "sliding_window": 4096,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "attention_factor": 1.2079441541679836,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
    },
    "nemotron-h-8b": {
        "architectures": ["NemotronHForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 21504,
        # 24 Mamba, 4 attention and 24 squared-ReLU MLP blocks: 28 of our layers, 4 MLP-free.
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 128,
        "time_step_min": 0.001,
        "mlp_hidden_act": "relu2",
        "max_position_embeddings": 8192,
        "layer_norm_epsilon": 1e-5,
    },
    "granite-4.0-h-small": {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 768,  # per expert
        "shared_intermediate_size": 1536,
        "num_hidden_layers": 40,
        # 36 Mamba and 4 attention layers (9:1); which four are attention is not read from
        # the published file here (a compile depends on the kinds, not their order).
        "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 72,
        "num_experts_per_tok": 10,
        "vocab_size": 100352,
        "tie_word_embeddings": True,
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "position_embedding_type": "nope",
        # Granite's multipliers (shape-neutral; values of the Granite 4.0 family's kind).
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0078125,
        "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    },
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,  # 3 Gated DeltaNet : 1 gated attention
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
    },
    # The published checkpoint is multimodal: the text model's config nests under
    # text_config (its widths from the model card: 64 layers, 16 x (3 Gated DeltaNet + 1
    # gated attention); 16 key / 48 value linear heads of 128; 24 query / 4 KV heads of 256).
    "qwen3.5-27b": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "vocab_size": 248320,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
            },
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
        },
    },
}
HF_CONFIGS["olmo-3-7b"]["layer_types"] *= 8


def real_config(name: str, num_layers: int | None = None) -> ModelConfig:
    cfg = config_from_hf(HF_CONFIGS[name], f"{name} config")
    if num_layers is None:
        return cfg
    kinds = cut_layers(cfg.layer_kinds, num_layers)
    sparse = tuple(i for i in cfg.sparse_layers if i < len(kinds))
    mlp_free = tuple(i for i in cfg.mlp_free_layers if i < len(kinds))
    return dataclasses.replace(cfg, layer_kinds=kinds, sparse_layers=sparse, mlp_free_layers=mlp_free)


def cut_layers(layer_kinds: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """The first ``num_layers`` kinds (at least one layer per kind the model has), the last
    of a repeated kind swapped for each kind they lack."""
    every = tuple(dict.fromkeys(layer_kinds))
    kinds = list(layer_kinds[: max(num_layers, len(every))])
    for kind in (k for k in every if k not in kinds):  # a repeat exists: len(kinds) >= len(every)
        last_repeat = max(i for i, k in enumerate(kinds) if kinds.count(k) > 1)
        kinds[last_repeat] = kind
    return tuple(kinds)
