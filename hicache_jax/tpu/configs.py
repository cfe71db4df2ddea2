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
}


def real_config(name: str, num_layers: int | None = None) -> ModelConfig:
    cfg = config_from_hf(HF_CONFIGS[name], f"{name} config")
    if num_layers is None:
        return cfg
    return dataclasses.replace(cfg, layer_kinds=cut_layers(cfg.layer_kinds, num_layers))


def cut_layers(layer_kinds: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """The first ``num_layers`` kinds (at least one layer per kind the model has), the last
    of a repeated kind swapped for each kind they lack."""
    every = tuple(dict.fromkeys(layer_kinds))
    kinds = list(layer_kinds[: max(num_layers, len(every))])
    for kind in (k for k in every if k not in kinds):  # a repeat exists: len(kinds) >= len(every)
        last_repeat = max(i for i, k in enumerate(kinds) if kinds.count(k) > 1)
        kinds[last_repeat] = kind
    return tuple(kinds)
