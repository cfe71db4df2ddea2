"""``config.json``'s ``architectures[0]`` -> how to build and load that model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hicache_jax.models.config import ModelConfig
from hicache_jax.models.hf import config as hf_config
from hicache_jax.models.hf.safetensors_io import CheckpointError
from hicache_jax.models.hf.weights import (
    BAMBA_NAMES,
    DEEPSEEK_NAMES,
    DEEPSEEK_V4_NAMES,
    GEMMA3_NAMES,
    GPT_OSS_NAMES,
    GRANITE_H_NAMES,
    LLAMA_NAMES,
    NEMOTRON_H_NAMES,
    OLMO3_NAMES,
    QWEN3_5_VL_NAMES,
    QWEN3_NEXT_NAMES,
    HFNames,
)


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    config_from_hf: Callable[[dict, str], ModelConfig]
    names: HFNames


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("MistralForCausalLM", hf_config.mistral, LLAMA_NAMES),
        Architecture("LlamaForCausalLM", hf_config.mistral, LLAMA_NAMES),
        Architecture("Gemma3ForCausalLM", hf_config.gemma3, GEMMA3_NAMES),
        Architecture("BambaForCausalLM", hf_config.bamba, BAMBA_NAMES),
        Architecture("Qwen3ForCausalLM", hf_config.qwen3, LLAMA_NAMES),
        Architecture("Qwen3MoeForCausalLM", hf_config.qwen3_moe, LLAMA_NAMES),
        Architecture("Olmo3ForCausalLM", hf_config.olmo3, OLMO3_NAMES),
        Architecture("GptOssForCausalLM", hf_config.gpt_oss, GPT_OSS_NAMES),
        Architecture("NemotronHForCausalLM", hf_config.nemotron_h, NEMOTRON_H_NAMES),
        Architecture("GraniteMoeHybridForCausalLM", hf_config.granite_moe_hybrid, GRANITE_H_NAMES),
        Architecture("Qwen3_5ForCausalLM", hf_config.qwen3_5, LLAMA_NAMES),
        # The published Qwen3.5 checkpoints: their text model (the vision tower is not read).
        Architecture("Qwen3_5ForConditionalGeneration", hf_config.qwen3_5, QWEN3_5_VL_NAMES),
        Architecture("Qwen3NextForCausalLM", hf_config.qwen3_next, QWEN3_NEXT_NAMES),
        Architecture("Qwen3_5MoeForCausalLM", hf_config.qwen3_5_moe, LLAMA_NAMES),
        Architecture("Qwen3_5MoeForConditionalGeneration", hf_config.qwen3_5_moe, QWEN3_5_VL_NAMES),
        Architecture("DeepseekV3ForCausalLM", hf_config.deepseek, DEEPSEEK_NAMES),
        Architecture("DeepseekV32ForCausalLM", hf_config.deepseek, DEEPSEEK_NAMES),
        Architecture("GlmMoeDsaForCausalLM", hf_config.deepseek, DEEPSEEK_NAMES),
        Architecture("DeepseekV4ForCausalLM", hf_config.deepseek_v4, DEEPSEEK_V4_NAMES),
    )
}


def architecture(name: str, where: str = "config.json") -> Architecture:
    if name not in ARCHITECTURES:
        raise CheckpointError(
            f"{where}: architecture {name!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    archs = hf.get("architectures")
    if not archs or not isinstance(archs, list):
        raise CheckpointError(f"{where}: no 'architectures' list")
    arch = architecture(archs[0], where)
    try:
        return arch.config_from_hf(hf, where)
    except KeyError as e:
        raise CheckpointError(f"{where}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: {e}") from e
