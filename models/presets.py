"""Built-in model presets with random weights (fixed seed), so demos and tests run offline.

``tiny*`` presets are for tests and notebooks; ``100m`` is the benchmark size. The tiny
tokenizer (byte-level BPE, 500 tokens) ships in ``hicache_jax/assets``.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

import hicache_jax
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.config import (
    Dsv4Config,
    GdnConfig,
    MambaConfig,
    MlaConfig,
    ModelConfig,
    MoEConfig,
    NextNConfig,
    YarnConfig,
)
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.sharding import shard_model

TOKENIZER = os.path.join(os.path.dirname(hicache_jax.__file__), "assets", "tiny_tokenizer.json")

_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eos_token_ids=(2,),
    bos_token_id=1,
    max_position_embeddings=8192,
)

# DeepSeek-style latent attention at tiny widths: a latent of 32 + a rope key of 8 per token.
_TINY_MLA = MlaConfig(
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    softmax_scale=24**-0.5,
    q_lora_rank=32,
)
# DeepSeek V3's router: sigmoid scores, a correction bias, 2 groups of 4, a shared expert.
_TINY_DEEPSEEK_MOE = MoEConfig(
    num_experts=8,
    top_k=2,
    intermediate=32,
    router="sigmoid_topk",
    norm_topk_prob=True,
    num_groups=2,
    topk_groups=1,
    routed_scaling=2.5,
    shared_intermediate=32,
)

# Every head's query of 16 + 8, a dense MLP, then two MoE layers (DeepSeek V3's layout).
_TINY_DEEPSEEK = _TINY | dict(num_kv_heads=4, head_dim=8, moe=_TINY_DEEPSEEK_MOE, sparse_layers=(1, 2))


def _dsv4_moe(num_experts: int, top_k: int, intermediate: int) -> MoEConfig:
    """DeepSeek V4's MoE: sqrt(softplus) scores with a correction bias, renormalised, routed
    scaling 1.5, clamped SwiGLU experts (limit 10) and one shared expert of their width."""
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate=intermediate,
        router="sqrtsoftplus_topk",
        norm_topk_prob=True,
        activation="silu_clamped",
        swiglu_limit=10.0,
        routed_scaling=1.5,
        shared_intermediate=intermediate,
    )


def _dsv4(name: str, v4: Dsv4Config, moe: MoEConfig, **fields) -> ModelConfig:
    """A DeepSeek V4 preset as ``models/hf/config.py`` reads one: one K=V head, a sink per
    head, MoE in every layer (``intermediate_size``, the experts' width, is no dense MLP's)."""
    kinds = fields["layer_kinds"]
    fields |= dict(num_kv_heads=1, intermediate_size=moe.intermediate)
    return ModelConfig(
        architecture=f"preset:{name}",
        partial_rotary_factor=v4.qk_rope_head_dim / fields["head_dim"],
        attention_sinks=True,
        moe=moe,
        sparse_layers=tuple(range(len(kinds))),
        dsv4=v4,
        **fields,
    )


PRESETS: dict[str, ModelConfig] = {
    # Gemma3-style local/global interleave: the default for demos.
    "tiny": ModelConfig(
        architecture="preset:tiny",
        layer_kinds=("sliding", "attention", "sliding", "attention"),
        sliding_window=32,
        rope_theta_sliding=10000.0,
        rope_theta=1e6,
        **_TINY,
    ),
    # Mistral-style: every layer sliding.
    "tiny-swa": ModelConfig(
        architecture="preset:tiny-swa", layer_kinds=("sliding",) * 2, sliding_window=32, **_TINY
    ),
    # Bamba-style Mamba2 + attention hybrid.
    "tiny-mamba": ModelConfig(
        architecture="preset:tiny-mamba",
        layer_kinds=("mamba", "attention", "mamba"),
        partial_rotary_factor=0.5,
        mamba=MambaConfig(
            num_heads=8, head_dim=16, state_size=16, num_groups=1, conv_kernel=4, chunk_size=64
        ),
        **_TINY,
    ),
    # Qwen3.5-style: three Gated DeltaNet layers, then gated full attention (output gate,
    # per-head q/k norm, a quarter of each head rotated, norms scaling by 1 + w).
    "tiny-qwen3.5": ModelConfig(
        architecture="preset:tiny-qwen3.5",
        layer_kinds=("gdn", "gdn", "gdn", "attention"),
        partial_rotary_factor=0.25,
        qk_norm=True,
        norm_offset=1.0,
        attention_output_gate=True,
        gdn=GdnConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel=4),
        **_TINY,
    ),
    # Nemotron-H-style: squared-ReLU MLPs and an MoE (sigmoid router, relu2 experts, a shared
    # expert) after some mixers only, attention without RoPE, Mamba2 with a time-step limit.
    "tiny-nemotron-h": ModelConfig(
        architecture="preset:tiny-nemotron-h",
        layer_kinds=("mamba", "mamba", "attention", "mamba"),
        mlp_free_layers=(1, 3),
        activation="relu2",
        mlp_gated=False,
        rope=False,
        mamba=MambaConfig(
            num_heads=8, head_dim=16, state_size=16, num_groups=2, conv_kernel=4, chunk_size=64, dt_min=1e-3
        ),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            intermediate=32,
            router="sigmoid_topk",
            norm_topk_prob=True,
            activation="relu2",
            num_groups=2,
            routed_scaling=2.5,
            shared_intermediate=64,
        ),
        sparse_layers=(2,),
        **_TINY,
    ),
    # Granite 4.0-H-style: Mamba2 and attention without RoPE, every layer an MoE beside a
    # shared MLP, Granite's multipliers.
    "tiny-granite-h": ModelConfig(
        architecture="preset:tiny-granite-h",
        layer_kinds=("mamba", "attention", "mamba"),
        rope=False,
        attention_multiplier=1 / 16,
        embed_scale=12.0,
        residual_multiplier=0.22,
        logits_scaling=4.0,
        tie_word_embeddings=True,
        mamba=MambaConfig(
            num_heads=8, head_dim=16, state_size=16, num_groups=1, conv_kernel=4, chunk_size=64
        ),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate=32, router="topk_softmax", shared_intermediate=64),
        sparse_layers=(0, 1, 2),
        **_TINY,
    ),
    # Qwen3-Next-style: tiny-qwen3.5's layers, each MLP an MoE (softmax top-k) beside a
    # shared expert scaled by sigmoid(Linear(hidden -> 1)).
    "tiny-qwen3-next": ModelConfig(
        architecture="preset:tiny-qwen3-next",
        layer_kinds=("gdn", "gdn", "gdn", "attention"),
        partial_rotary_factor=0.25,
        qk_norm=True,
        norm_offset=1.0,
        attention_output_gate=True,
        gdn=GdnConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel=4),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            intermediate=32,
            norm_topk_prob=True,
            shared_intermediate=64,
            shared_gate=True,
        ),
        sparse_layers=(0, 1, 2, 3),
        **_TINY,
    ),
    # Qwen3-MoE-style mixture of experts (per-head q/k norm) over both window kinds, with
    # one dense layer among the MoE ones.
    "tiny-moe": ModelConfig(
        architecture="preset:tiny-moe",
        layer_kinds=("sliding", "attention", "sliding", "attention"),
        sliding_window=32,
        qk_norm=True,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate=32, norm_topk_prob=True),
        sparse_layers=(0, 2, 3),
        **_TINY,
    ),
    # gpt-oss-style: alternating windows, attention sinks and biases, YaRN, and MoE in every
    # layer (router bias, softmax over the top-k, clamped SwiGLU experts with biases).
    "tiny-gpt-oss": ModelConfig(
        architecture="preset:tiny-gpt-oss",
        layer_kinds=("sliding", "attention", "sliding", "attention"),
        sliding_window=32,
        attention_bias=True,
        attention_sinks=True,
        rope_theta=150000.0,
        rope_yarn=YarnConfig(factor=32.0, original_max_position=4096, truncate=False),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            intermediate=32,
            router="topk_softmax",
            router_bias=True,
            expert_bias=True,
            activation="swiglu_clamped",
        ),
        sparse_layers=(0, 1, 2, 3),
        **_TINY,
    ),
    # DeepSeek V3-style: MLA in every layer, a dense MLP, then MoE (Kimi K2's layout).
    "tiny-mla": ModelConfig(
        architecture="preset:tiny-mla", layer_kinds=("mla",) * 3, mla=_TINY_MLA, **_TINY_DEEPSEEK
    ),
    # GLM-5-style sparse attention: the indexer keeps the best 32 positions per query (most
    # test prompts are longer); the middle layer reuses the first layer's picks.
    "tiny-dsa": ModelConfig(
        architecture="preset:tiny-dsa",
        layer_kinds=("dsa", "dsa_shared", "dsa"),
        mla=dataclasses.replace(
            _TINY_MLA, index_n_heads=4, index_head_dim=16, index_topk=32, index_rope_interleave=True
        ),
        **_TINY_DEEPSEEK,
    ),
    # DeepSeek V4-style: a sliding window of one K=V head of 32 (its last 8 channels rotated)
    # in every layer, CSA (an entry per 4 tokens; the indexer keeps the best 8 entries, 32
    # tokens, per query: most test prompts are longer) and HCA (an entry per 16 tokens, so
    # one per page at the suite's page size 16); the window of 20 is a page and a bit. A
    # hash-routed MoE layer, then top-k ones; two residual streams; YaRN on compressed layers.
    "tiny-dsv4": _dsv4(
        "tiny-dsv4",
        Dsv4Config(
            q_lora_rank=24,
            o_groups=2,
            o_lora_rank=16,
            qk_rope_head_dim=8,
            csa_rate=4,
            hca_rate=16,
            compress_yarn=YarnConfig(factor=4.0, original_max_position=1024),
            index_n_heads=2,
            index_head_dim=16,
            index_topk=8,
            hc_mult=2,
            hash_layers=(0,),
        ),
        _dsv4_moe(num_experts=4, top_k=2, intermediate=32),
        layer_kinds=("swa_mqa", "csa", "hca"),
        sliding_window=20,
        **(_TINY | dict(head_dim=32)),
    ),
    # ~100M parameters: 5 local : 1 global, for benchmarks.
    "100m": ModelConfig(
        architecture="preset:100m",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        layer_kinds=(("sliding",) * 5 + ("attention",)) * 2,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        sliding_window=512,
        rope_theta_sliding=10000.0,
        rope_theta=1e6,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        max_position_embeddings=32768,
    ),
    # ~100M parameters, Qwen3.5-style: 3 Gated DeltaNet : 1 gated full attention, for the
    # recurrent-state benchmarks (head dims 128 as published; 4 key heads, so tp up to 4).
    "100m-gdn": ModelConfig(
        architecture="preset:100m-gdn",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2816,
        layer_kinds=(("gdn",) * 3 + ("attention",)) * 2,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        partial_rotary_factor=0.25,
        rope_theta=1e7,
        qk_norm=True,
        norm_offset=1.0,
        attention_output_gate=True,
        gdn=GdnConfig(num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128, conv_kernel=4),
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        max_position_embeddings=32768,
    ),
    # ~100M parameters, DeepSeek V3's attention at its published latent (512 + 64 per token,
    # 12 heads of 128 + 64 query dims): for the latent-cache benchmarks (``benchmarks/decode.py``).
    "100m-mla": ModelConfig(
        architecture="preset:100m-mla",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=1536,
        layer_kinds=("mla",) * 10,
        num_heads=12,
        num_kv_heads=12,
        head_dim=64,
        mla=MlaConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            softmax_scale=192**-0.5,
            q_lora_rank=256,
        ),
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        max_position_embeddings=32768,
    ),
    # ~100M parameters, 32M active per token: 16 experts, 2 per token, in every layer;
    # 3 local : 1 global. For the MoE benchmarks (``benchmarks/decode.py``).
    "100m-moe": ModelConfig(
        architecture="preset:100m-moe",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        layer_kinds=(("sliding",) * 3 + ("attention",)) * 2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        sliding_window=512,
        qk_norm=True,
        rope_theta=1e6,
        moe=MoEConfig(num_experts=16, top_k=2, intermediate=384, norm_topk_prob=True),
        sparse_layers=tuple(range(8)),
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        max_position_embeddings=32768,
    ),
    # ~100M parameters, DeepSeek V4 Flash's attention at its published widths (one K=V head
    # of 512, 64 channels rotated, a window of 128, CSA at 4 tokens an entry with an indexer
    # of 128-wide keys, HCA at 128) and its layout (two sliding layers, then CSA and HCA
    # alternating; three hash-routed MoE layers), narrower: 8 heads, hidden 512, 16 experts
    # (99.5M parameters, 55.4M active). ``page_size`` must be a multiple of 128. For
    # ``benchmarks/decode.py``.
    "100m-dsv4": _dsv4(
        "100m-dsv4",
        Dsv4Config(
            q_lora_rank=256,
            o_groups=2,
            o_lora_rank=256,
            qk_rope_head_dim=64,
            csa_rate=4,
            hca_rate=128,
            index_n_heads=8,
            index_head_dim=128,
            index_topk=64,
            hc_mult=4,
            hash_layers=(0, 1, 2),
        ),
        _dsv4_moe(num_experts=16, top_k=2, intermediate=256),
        vocab_size=32000,
        hidden_size=512,
        layer_kinds=("swa_mqa",) * 2 + ("csa", "hca") * 3,
        num_heads=8,
        head_dim=512,
        sliding_window=128,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        max_position_embeddings=32768,
    ),
}


def _with_mtp(name: str, base: str, nextn: NextNConfig) -> None:
    """A preset with one multi-token-prediction block (``layers/mtp_nextn.py``): the base
    preset's weights, plus the block's (random) for ``--speculative_algorithm NEXTN``."""
    PRESETS[name] = dataclasses.replace(PRESETS[base], architecture=f"preset:{name}", nextn=nextn)


_with_mtp("tiny-mla-mtp", "tiny-mla", NextNConfig(1, "mla", sparse=True, style="deepseek"))
_with_mtp("tiny-dsa-mtp", "tiny-dsa", NextNConfig(1, "dsa", sparse=True, style="deepseek"))
_with_mtp("tiny-qwen3.5-mtp", "tiny-qwen3.5", NextNConfig(1, "attention", sparse=False, style="qwen"))
PRESETS["tiny-dsv4-mtp"] = dataclasses.replace(  # DeepSeek V4's own block (``layers/mtp.py``)
    PRESETS["tiny-dsv4"],
    architecture="preset:tiny-dsv4-mtp",
    dsv4=dataclasses.replace(PRESETS["tiny-dsv4"].dsv4, num_nextn_predict_layers=1),
)


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def _hash_routes(model: CausalLM, cfg: ModelConfig, seed: int) -> None:
    """Random routes for DeepSeek V4's hash layers: each token id's ``top_k`` distinct
    experts (a checkpoint's ``tid2eid`` is loaded; the layer's own is zeros, which would send
    every token to expert 0 twice)."""
    m = cfg.moe
    rng = np.random.default_rng(seed)
    for i in cfg.dsv4.hash_layers:
        routes = np.argsort(rng.random((cfg.vocab_size, m.num_experts)), axis=1)[:, : m.top_k]
        model.layers[i].mlp.tid2eid[...] = jnp.asarray(routes, jnp.int32)


def build_preset(
    name: str, *, seed: int = 0, dtype=jnp.float32, kernels: KernelConfig | None = None
) -> CausalLM:
    cfg = preset_config(name)
    model = CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), kernels=kernels)
    if cfg.dsv4 is not None:
        _hash_routes(model, cfg, seed)
    shard_model(model)  # the same random weights at every tp_size, split over the mesh
    return model
