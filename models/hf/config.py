"""Hugging Face ``config.json`` -> ModelConfig, one function per architecture."""

from __future__ import annotations

import logging
import math

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
from hicache_jax.models.hf import fp8_blocks
from hicache_jax.models.hf.safetensors_io import CheckpointError

log = logging.getLogger(__name__)


def _float(v) -> float:
    """Numbers as transformers writes them (``{"__float__": "Infinity"}`` included)."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _eos(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(params: dict | None, fallback_theta: float, where: str) -> tuple[float, float]:
    """(theta, linear scaling factor) from a rope_parameters entry."""
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise CheckpointError(f"{where}: rope_type {kind!r} is not supported (default, linear)")
    factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    return float(params.get("rope_theta", fallback_theta)), factor


def _yarn(params: dict, hf: dict, truncate: bool) -> YarnConfig:
    """A ``rope_type: yarn`` entry (``factor`` defaults to max / original positions, as
    transformers does)."""
    original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    scale = params.get("attention_factor")
    return YarnConfig(
        factor=float(factor),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=None if scale is None else float(scale),
        truncate=bool(truncate),
    )


def _rope_by_type(hf: dict, where: str, default_theta: float) -> dict:
    """Per layer type rope settings -> ModelConfig's rope fields. Accepts transformers'
    ``rope_parameters`` keyed by layer type (``sliding_attention``, ``full_attention``) or one
    entry (``rope_parameters`` / ``rope_scaling`` with ``rope_theta``) for every layer; for
    per-type entries the YaRN range is rounded outwards (transformers reads ``truncate`` only
    from the top level)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        truncate = True
    else:
        one = dict(params or hf.get("rope_scaling") or {})
        one.setdefault("rope_theta", hf.get("rope_theta", default_theta))
        full = sliding = one
        truncate = one.get("truncate", True)
    out = {}
    for name, entry in (("full", full), ("sliding", sliding)):
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise CheckpointError(
                f"{where}: rope_type {kind!r} ({name} layers) is not supported (default, yarn)"
            )
        out[name] = (float(entry.get("rope_theta", hf.get("rope_theta", default_theta))), kind)
    yarn_full = _yarn(full, hf, truncate) if out["full"][1] == "yarn" else None
    yarn_sliding = _yarn(sliding, hf, truncate) if out["sliding"][1] == "yarn" else None
    if yarn_full and yarn_sliding and yarn_full != yarn_sliding:
        raise CheckpointError(
            f"{where}: different YaRN settings for sliding and full layers are not supported"
        )
    if yarn_sliding and not yarn_full:
        raise CheckpointError(f"{where}: YaRN on sliding layers only is not supported")
    return dict(
        rope_theta=out["full"][0],
        rope_theta_sliding=out["sliding"][0],
        rope_yarn=yarn_full,
        rope_yarn_sliding=yarn_sliding is not None,
    )


def _common(hf: dict, arch: str, layer_kinds: tuple[str, ...], where: str) -> dict:
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    return dict(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=h,
        intermediate_size=hf["intermediate_size"],
        layer_kinds=layer_kinds,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or h // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        eos_token_ids=_eos(hf),
        bos_token_id=hf.get("bos_token_id"),
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
    )


def _check(hf: dict, where: str, **expected):
    for key, want in expected.items():
        if hf.get(key, want) != want:
            raise CheckpointError(f"{where}: {key}={hf[key]!r} is not supported (expected {want!r})")


def mistral(hf: dict, where: str) -> ModelConfig:
    """MistralForCausalLM (every layer sliding when ``sliding_window`` is set) and
    LlamaForCausalLM (full attention)."""
    arch = hf["architectures"][0]
    _check(hf, where, hidden_act="silu", attention_bias=False, mlp_bias=False)
    window = hf.get("sliding_window") if arch == "MistralForCausalLM" else None
    kind = "sliding" if window else "attention"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta, factor = _rope(rope, hf.get("rope_theta", 10000.0), where)
    return ModelConfig(
        **_common(hf, arch, (kind,) * hf["num_hidden_layers"], where),
        rope_theta=theta,
        rope_linear_factor=factor,
        sliding_window=window,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def qwen3(hf: dict, where: str) -> ModelConfig:
    """Qwen3ForCausalLM (dense): Llama's layout with an RMSNorm over each head's q and k;
    sliding-window layers where ``layer_types`` puts them (``use_sliding_window``)."""
    _check(hf, where, hidden_act="silu", attention_bias=False)
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["full_attention"] * n
    kinds = tuple({"sliding_attention": "sliding", "full_attention": "attention"}[t] for t in types)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta, factor = _rope(rope, hf.get("rope_theta", 1e6), where)
    return ModelConfig(
        **_common(hf, "Qwen3ForCausalLM", kinds, where),
        rope_theta=theta,
        rope_linear_factor=factor,
        sliding_window=hf.get("sliding_window") if "sliding" in kinds else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
    )


def qwen3_moe(hf: dict, where: str) -> ModelConfig:
    """Qwen3MoeForCausalLM: Qwen3's attention; an MoE MLP in layer ``i`` unless ``i`` is in
    ``mlp_only_layers``, every ``decoder_sparse_step``-th layer. With ``use_sliding_window``
    every layer is sliding (the model has no per-layer window)."""
    _check(hf, where, hidden_act="silu", attention_bias=False)
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    kinds = ("sliding" if window else "attention",) * n
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(n) if i not in dense_only and experts > 0 and (i + 1) % step == 0)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta, factor = _rope(rope, hf.get("rope_theta", 1e6), where)
    moe = None
    if sparse:
        moe = MoEConfig(
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            intermediate=hf["moe_intermediate_size"],
            router="softmax_topk",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    return ModelConfig(
        **_common(hf, "Qwen3MoeForCausalLM", kinds, where),
        rope_theta=theta,
        rope_linear_factor=factor,
        sliding_window=window,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
        moe=moe,
        sparse_layers=sparse,
    )


def olmo3(hf: dict, where: str) -> ModelConfig:
    """Olmo3ForCausalLM: sliding-window layers where ``layer_types`` puts them (three of
    every four by default), q and k RMSNorm-ed over the whole projection, a norm after
    attention and after the MLP and none before; YaRN on the full-attention layers."""
    _check(hf, where, hidden_act="silu", attention_bias=False)
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)
    ]
    kinds = tuple({"sliding_attention": "sliding", "full_attention": "attention"}[t] for t in types)
    return ModelConfig(
        **_common(hf, "Olmo3ForCausalLM", kinds, where),
        **_rope_by_type(hf, where, 500000.0),
        sliding_window=hf.get("sliding_window") if "sliding" in kinds else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
        qk_norm_over="all",
        pre_norms=False,
    )


def gpt_oss(hf: dict, where: str) -> ModelConfig:
    """GptOssForCausalLM: sliding-window and full-attention layers from ``layer_types``
    (alternating in the published models), attention sinks, q/k/v/o biases, YaRN on every
    layer; an MoE MLP in every layer (router with a bias, softmax over the top-k logits,
    clamped SwiGLU experts with biases). MXFP4 expert weights are dequantized on load."""
    n = hf["num_hidden_layers"]
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    types = hf.get("layer_types") or alternating
    kinds = tuple({"sliding_attention": "sliding", "full_attention": "attention"}[t] for t in types)
    quant = hf.get("quantization_config")
    if quant and quant.get("quant_method") == "fp8":
        fp8_blocks.check_config(quant, where)
    elif quant and quant.get("quant_method") != "mxfp4":
        raise CheckpointError(
            f"{where}: quantization {quant.get('quant_method')!r} is not supported (mxfp4, fp8)"
        )
    moe = MoEConfig(
        num_experts=hf.get("num_local_experts", hf.get("num_experts")),
        top_k=hf.get("num_experts_per_tok", hf.get("experts_per_token")),
        intermediate=hf["intermediate_size"],
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="swiglu_clamped",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )
    common = _common(hf, "GptOssForCausalLM", kinds, where)
    common["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-5))
    return ModelConfig(
        **common,
        **_rope_by_type(hf, where, 150000.0),
        sliding_window=hf.get("sliding_window") if "sliding" in kinds else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        moe=moe,
        sparse_layers=tuple(range(n)),
    )


def gemma3(hf: dict, where: str) -> ModelConfig:
    """Gemma3ForCausalLM, text only: interleaved local (sliding) and global layers."""
    if "text_config" in hf:
        raise CheckpointError(f"{where}: multimodal Gemma3 checkpoints are not supported (text only)")
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{where}: use_bidirectional_attention is not supported")
    _check(hf, where, attention_bias=False)
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{where}: hidden_activation {act!r} is not supported")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    kinds = tuple({"sliding_attention": "sliding", "full_attention": "attention"}[t] for t in types)
    rp = hf.get("rope_parameters") or {}
    if "full_attention" in rp:
        g_theta, g_factor = _rope(rp["full_attention"], 1e6, where)
        l_theta, _ = _rope(rp.get("sliding_attention"), 1e4, where)
    else:
        g_theta, g_factor = _rope(hf.get("rope_scaling"), hf.get("rope_theta", 1e6), where)
        l_theta = float(hf.get("rope_local_base_freq", 1e4))
    h = hf["hidden_size"]
    return ModelConfig(
        **_common(hf, "Gemma3ForCausalLM", kinds, where),
        activation="gelu_tanh",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        rope_theta=g_theta,
        rope_linear_factor=g_factor,
        rope_theta_sliding=l_theta,
        sliding_window=hf.get("sliding_window", 4096),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        # transformers' Gemma3 attention never applies attn_logit_softcapping (released
        # Gemma3 configs set it to null); follow the reference.
        attn_logit_softcap=None,
        final_logit_softcap=hf.get("final_logit_softcapping"),
        qk_norm=True,
        norm_offset=1.0,
        embed_scale=math.sqrt(h),
        sandwich_norms=True,
    )


def _bamba_mamba(hf: dict, where: str) -> MambaConfig:
    """The Mamba2 mixer of Bamba's config fields (``mamba_*``, ``time_step_limit``), which
    Granite 4.0-H shares."""
    h = hf["hidden_size"]
    expand = hf.get("mamba_expand", 2)
    heads = hf.get("mamba_n_heads", 128)
    d_head = hf.get("mamba_d_head", "auto")
    if d_head == "auto":
        d_head = expand * h // heads
    if d_head * heads != expand * h:
        raise CheckpointError(f"{where}: mamba_d_head * mamba_n_heads != mamba_expand * hidden_size")
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    return MambaConfig(
        num_heads=heads,
        head_dim=d_head,
        state_size=hf.get("mamba_d_state", 256),
        num_groups=hf.get("mamba_n_groups", 1),
        conv_kernel=hf.get("mamba_d_conv", 4),
        chunk_size=hf.get("mamba_chunk_size", 256),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        dt_min=_float(limit[0]),
        dt_max=_float(limit[1]),
    )


def bamba(hf: dict, where: str) -> ModelConfig:
    """BambaForCausalLM: Mamba2 layers with full attention at ``attn_layer_indices``."""
    _check(hf, where, hidden_act="silu", attention_bias=False, mlp_bias=False)
    n = hf["num_hidden_layers"]
    attn = set(hf.get("attn_layer_indices") or [])
    kinds = tuple("attention" if i in attn else "mamba" for i in range(n))
    rope = hf.get("rope_parameters") or {}
    theta, factor = _rope(rope, hf.get("rope_theta", 10000.0), where)
    mamba = _bamba_mamba(hf, where)
    common = _common(hf, "BambaForCausalLM", kinds, where)
    common["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-5))
    return ModelConfig(
        **common,
        rope_theta=theta,
        rope_linear_factor=factor,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mamba=mamba,
    )


def _text_config(hf: dict) -> dict:
    """A multimodal checkpoint's text model config (``text_config``, as Qwen3.5's
    ``...ForConditionalGeneration`` nests it; the top level keeps what it does not say, such
    as ``tie_word_embeddings``), or a text-only config itself."""
    text = hf.get("text_config")
    if text is None:
        return hf
    return {k: v for k, v in hf.items() if k != "text_config"} | text


def _gated_deltanet(hf: dict, arch: str, where: str, **extra) -> ModelConfig:
    """The Qwen3-Next / Qwen3.5 text stack: Gated DeltaNet layers ("linear_attention") and
    full attention ("full_attention") from ``layer_types`` (every ``full_attention_interval``
    -th full by default); attention with an output gate, per-head q/k RMSNorm and partial
    rotary; every RMSNorm (not the GDN's gated one) scales by ``1 + w``. Qwen3.5's
    multimodal rope (``mrope_section``) gives a text-only sequence the same position on
    each of its three sections, which is plain rope. The ``mtp_num_hidden_layers``
    multi-token-prediction blocks (``mtp.*``: a full-attention layer each, MoE where the
    stack has MoE) are built and loaded for drafting (``layers/mtp_nextn.py``)."""
    _check(hf, where, hidden_act="silu", attention_bias=False)
    n = hf["num_hidden_layers"]
    every = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
    ]
    kinds = tuple({"linear_attention": "gdn", "full_attention": "attention"}[t] for t in types)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta, factor = _rope(rope, hf.get("rope_theta", 10000.0), where)
    gdn = GdnConfig(
        num_k_heads=hf["linear_num_key_heads"],
        num_v_heads=hf["linear_num_value_heads"],
        head_k_dim=hf["linear_key_head_dim"],
        head_v_dim=hf["linear_value_head_dim"],
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
    )
    if hf.get("mtp_use_dedicated_embeddings"):
        raise CheckpointError(
            f"{where}: mtp_use_dedicated_embeddings true: "
            "MTP blocks with their own embedding are not supported"
        )
    moe = extra.get("moe")
    key = "mtp_num_hidden_layers"
    nextn = _nextn(hf.get(key) or 0, "attention", moe is not None, "qwen", key, where)
    return ModelConfig(
        **_common(hf, arch, kinds, where),
        nextn=nextn,
        rope_theta=theta,
        rope_linear_factor=factor,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
        norm_offset=1.0,
        attention_output_gate=True,
        gdn=gdn,
        **extra,
    )


def qwen3_5(hf: dict, where: str) -> ModelConfig:
    """Qwen3_5ForCausalLM (dense) and the text model of Qwen3_5ForConditionalGeneration
    (the published checkpoints; the vision tower is not read)."""
    return _gated_deltanet(_text_config(hf), hf["architectures"][0], where)


def _qwen_next_moe(hf: dict, norm_topk_prob: bool) -> MoEConfig:
    """Qwen3-Next's MoE block: softmax top-k routing and a shared expert whose output is
    scaled by sigmoid(shared_expert_gate(x)) before it joins the routed experts'."""
    return MoEConfig(
        num_experts=hf["num_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate=hf["moe_intermediate_size"],
        router="softmax_topk",
        norm_topk_prob=norm_topk_prob,
        shared_intermediate=hf["shared_expert_intermediate_size"],
        shared_gate=True,
    )


def qwen3_next(hf: dict, where: str) -> ModelConfig:
    """Qwen3NextForCausalLM: Qwen3.5's layers (its fused GDN projections regrouped at load),
    an MoE MLP in layer ``i`` unless ``i`` is in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th layer; dense MLPs of ``intermediate_size`` elsewhere."""
    n = hf["num_hidden_layers"]
    step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    experts = hf.get("num_experts", 0)
    sparse = tuple(i for i in range(n) if i not in dense_only and experts > 0 and (i + 1) % step == 0)
    moe = _qwen_next_moe(hf, bool(hf.get("norm_topk_prob", True))) if sparse else None
    return _gated_deltanet(hf, "Qwen3NextForCausalLM", where, moe=moe, sparse_layers=sparse)


def qwen3_5_moe(hf: dict, where: str) -> ModelConfig:
    """Qwen3_5MoeForCausalLM and the text model of Qwen3_5MoeForConditionalGeneration:
    Qwen3.5's layers, each with Qwen3-Next's MoE block (the top-k weights always
    renormalised)."""
    text = _text_config(hf)
    # No dense MLP: intermediate_size is read only for the shared expert's width.
    text = {**text, "intermediate_size": text["shared_expert_intermediate_size"]}
    moe = _qwen_next_moe(text, norm_topk_prob=True)
    layers = tuple(range(text["num_hidden_layers"]))
    return _gated_deltanet(text, hf["architectures"][0], where, moe=moe, sparse_layers=layers)


# Nemotron-H's block letters (``hybrid_override_pattern``) and the names transformers 5 gives
# them (``layers_block_type``).
_NEMOTRON_BLOCKS = {
    "M": "M", "*": "*", "-": "-", "E": "E",
    "mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E",
}  # fmt: skip


def nemotron_h_layers(pattern: str, where: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """``hybrid_override_pattern`` -> (layer kinds, MLP-free layers, MoE layers).

    Each Nemotron-H block is ``x += mixer(norm(x))`` with one mixer: Mamba2 (``M``),
    attention (``*``), a dense MLP (``-``) or an MoE (``E``). A mixer block and the MLP block
    after it make one of our layers; a mixer block with none after it, a layer without MLP::

        HF block    0 1 2 3 4 5
        pattern     M - M * E M
        our layer   0 0 1 2 2 3    (mamba+MLP, mamba, attention+MoE, mamba)
    """
    kinds, mlp_free, sparse = [], [], []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c not in "M*-E":
            raise CheckpointError(f"{where}: hybrid_override_pattern {pattern!r}: unknown block {c!r} at {i}")
        if c in "-E":
            raise CheckpointError(
                f"{where}: hybrid_override_pattern {pattern!r}: the MLP block {c!r} at {i} follows no "
                "Mamba or attention block (an MLP block must come right after one)"
            )
        kinds.append("mamba" if c == "M" else "attention")
        after = pattern[i + 1] if i + 1 < len(pattern) else None
        if after in ("-", "E"):
            if after == "E":
                sparse.append(len(kinds) - 1)
            i += 2
        else:
            mlp_free.append(len(kinds) - 1)
            i += 1
    if not kinds:
        raise CheckpointError(f"{where}: hybrid_override_pattern is empty")
    return tuple(kinds), tuple(mlp_free), tuple(sparse)


def nemotron_h(hf: dict, where: str) -> ModelConfig:
    """NemotronHForCausalLM: Mamba2, attention (no RoPE), squared-ReLU MLP and MoE blocks
    from ``hybrid_override_pattern`` (or transformers 5's ``layers_block_type``), grouped into
    our layers by ``nemotron_h_layers``. The MoE routes DeepSeek-V3's way (sigmoid scores,
    a correction bias on the choice, grouped top-k) to squared-ReLU experts beside one shared
    expert. The Mamba2 mixer is Bamba's but for its projections' bias (``use_bias``). The time
    step is clamped to ``time_step_limit`` (``mamba_dt_limit``), as in Mamba2's reference, vLLM
    and transformers from 5.25 (up to 5.24 transformers floored it at ``time_step_min``, an
    initialisation bound, and ignored the limit; real checkpoints' limit is (0, inf)).
    ``residual_in_fp32`` changes nothing in transformers' forward, nor here."""
    _check(hf, where, mlp_hidden_act="relu2", mamba_hidden_act="silu", mlp_bias=False)
    if "hybrid_override_pattern" in hf:
        pattern = hf["hybrid_override_pattern"]
    else:
        blocks = hf.get("layers_block_type") or hf.get("layer_types")
        if blocks is None:
            raise KeyError("hybrid_override_pattern")
        bad = [b for b in blocks if b not in _NEMOTRON_BLOCKS]
        if bad:
            raise CheckpointError(f"{where}: layers_block_type has unknown blocks {bad}")
        pattern = "".join(_NEMOTRON_BLOCKS[b] for b in blocks)
    if not isinstance(pattern, str):
        raise CheckpointError(f"{where}: hybrid_override_pattern {pattern!r} is not a string")
    kinds, mlp_free, sparse = nemotron_h_layers(pattern, where)

    def legacy(name: str, old: str, default):  # transformers renamed some fields in v5
        return hf.get(name, hf.get(old, default))

    limit = legacy("time_step_limit", "mamba_dt_limit", None) or (0.0, math.inf)
    mamba = MambaConfig(
        num_heads=hf.get("mamba_num_heads", 128),
        head_dim=hf.get("mamba_head_dim", 64),
        state_size=hf.get("ssm_state_size", 128),
        num_groups=legacy("n_groups", "mamba_n_groups", 8),
        conv_kernel=legacy("conv_kernel", "mamba_d_conv", 4),
        chunk_size=legacy("chunk_size", "mamba_chunk_size", 128),
        conv_bias=bool(legacy("use_conv_bias", "mamba_conv_bias", True)),
        proj_bias=bool(hf.get("use_bias", False)),
        dt_min=_float(limit[0]),
        dt_max=_float(limit[1]),
    )
    moe = None
    if sparse:
        if hf.get("moe_latent_size") is not None:
            raise CheckpointError(f"{where}: moe_latent_size={hf['moe_latent_size']} is not supported")
        moe = MoEConfig(
            num_experts=hf.get("n_routed_experts", hf.get("num_local_experts")),
            top_k=hf["num_experts_per_tok"],
            intermediate=hf["moe_intermediate_size"],
            router="sigmoid_topk",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            activation="relu2",
            num_groups=hf.get("n_group", 1),
            topk_groups=hf.get("topk_group", 1),
            routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
            shared_intermediate=hf["moe_shared_expert_intermediate_size"],
        )
    heads = hf.get("num_attention_heads", 32)
    common = _common(
        {"num_attention_heads": heads, "num_key_value_heads": 8, "intermediate_size": 21504, **hf},
        "NemotronHForCausalLM",
        kinds,
        where,
    )
    common["head_dim"] = hf.get("head_dim") or hf.get("attention_head_dim") or 128
    common["rms_norm_eps"] = float(hf.get("layer_norm_epsilon", 1e-5))
    common["max_position_embeddings"] = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        **common,
        activation="relu2",
        mlp_gated=False,
        mlp_free_layers=mlp_free,
        rope=False,
        tie_word_embeddings=False,  # transformers' NemotronH never ties them
        mamba=mamba,
        moe=moe,
        sparse_layers=sparse,
    )


# Granite 4.0-H's ``layer_types``, as published and as transformers 5 writes them.
_GRANITE_LAYERS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}


def granite_moe_hybrid(hf: dict, where: str) -> ModelConfig:
    """GraniteMoeHybridForCausalLM (Granite 4.0-H): Mamba2 (Bamba's mixer) and attention
    layers from ``layer_types``, attention with RoPE or none (``position_embedding_type``
    "rope" or "nope"), and in every layer a shared SwiGLU MLP, plus (``num_local_experts``
    > 0) an MoE (top-k router logits, softmax over those) whose output is added to it.
    Granite's multipliers: ``embedding_multiplier``, ``attention_multiplier`` (the softmax
    scale), ``residual_multiplier`` (on each sub-layer's output) and ``logits_scaling``
    (divides the logits)."""
    _check(hf, where, hidden_act="silu")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n
    bad = [t for t in types if t not in _GRANITE_LAYERS]
    if bad:
        raise CheckpointError(f"{where}: layer_types has unknown types {bad} (mamba, attention)")
    if len(types) != n:
        raise CheckpointError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers={n}")
    kinds = tuple(_GRANITE_LAYERS[t] for t in types)
    position = hf.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise CheckpointError(f"{where}: position_embedding_type {position!r} is not supported (rope, nope)")
    mamba = _bamba_mamba(hf, where)
    shared = hf.get("shared_intermediate_size", 1024)
    experts = hf.get("num_local_experts", 8) or 0
    moe = None
    if experts:
        moe = MoEConfig(
            num_experts=experts,
            top_k=hf.get("num_experts_per_tok", 2),
            intermediate=hf.get("intermediate_size", 11008),
            router="topk_softmax",
            shared_intermediate=shared,
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta, factor = _rope(rope, hf.get("rope_theta", 10000.0), where)
    # The shared MLP is the dense MLP of a layer without experts, the shared expert otherwise.
    common = _common({**hf, "intermediate_size": shared}, "GraniteMoeHybridForCausalLM", kinds, where)
    multiplier = hf.get("attention_multiplier", 1.0)
    return ModelConfig(
        **common,
        rope=position == "rope",
        rope_theta=theta,
        rope_linear_factor=factor,
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_multiplier=None if multiplier is None else float(multiplier),
        embed_scale=float(hf.get("embedding_multiplier") or 1.0),
        residual_multiplier=float(hf.get("residual_multiplier") or 1.0),
        logits_scaling=float(hf.get("logits_scaling") or 1.0),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mamba=mamba,
        moe=moe,
        sparse_layers=tuple(range(n)) if moe else (),
    )


def _mla(hf: dict, where: str, arch: str) -> MlaConfig:
    """The attention of the DeepSeek V3 line: MLA, and for V3.2 / GLM-5 its indexer."""
    nope, rot = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    scale = (nope + rot) ** -0.5
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    indexer = arch != "DeepseekV3ForCausalLM"
    return MlaConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rot,
        v_head_dim=hf["v_head_dim"],
        softmax_scale=scale,
        q_lora_rank=hf.get("q_lora_rank") or 0,
        # transformers: V3 by its flag; V3.2's and GLM-5's attention always interleaved.
        rope_interleave=bool(hf.get("rope_interleave", True)) if not indexer else True,
        index_n_heads=hf["index_n_heads"] if indexer else 0,
        index_head_dim=hf["index_head_dim"] if indexer else 0,
        index_topk=hf["index_topk"] if indexer else 0,
        index_rope_interleave=arch == "GlmMoeDsaForCausalLM",  # V3.2's indexer rotates halves
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def deepseek(hf: dict, where: str) -> ModelConfig:
    """DeepseekV3ForCausalLM (Kimi K2 too; MLA), DeepseekV32ForCausalLM and
    GlmMoeDsaForCausalLM (GLM-5): MLA attention, DSA's indexer in V3.2 and GLM-5 (GLM-5's
    ``indexer_types: shared`` layers reuse the previous layer's picks), and MoE MLPs after
    ``first_k_dense_replace`` dense ones (or where ``mlp_layer_types`` says ``sparse``):
    sigmoid scores with a correction bias on the choice, grouped top-k, routed scaling and
    ``n_shared_experts`` shared experts. YaRN's ``mscale_all_dim`` scales the softmax.
    The ``num_nextn_predict_layers`` multi-token-prediction layers past ``num_hidden_layers``
    are built and loaded as drafting blocks (``layers/mtp_nextn.py``): each MLA (V3) or DSA
    attention with its own indexer, and an MoE."""
    arch = hf["architectures"][0]
    _check(hf, where, hidden_act="silu", attention_bias=False)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("attention_factor") is None:
        factor, mscale, all_dim = rope.get("factor"), rope.get("mscale"), rope.get("mscale_all_dim")
        if factor and mscale and all_dim:  # transformers' YaRN scale for DeepSeek's two mscales
            rope["attention_factor"] = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
        hf = {**hf, "rope_parameters": rope}
    n, nextn = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or 0
    if arch == "DeepseekV3ForCausalLM":
        kinds = ("mla",) * n
    else:
        types = hf.get("indexer_types") or ["full"] * n
        if len(types) == n + nextn:  # listing the MTP layers too: each has its own indexer
            types = types[:n]
        bad = [t for t in types if t not in ("full", "shared")]
        if bad or len(types) != n:
            raise CheckpointError(f"{where}: indexer_types {types!r}: want {n} of 'full' / 'shared'")
        kinds = tuple("dsa" if t == "full" else "dsa_shared" for t in types)
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        dense = min(hf.get("first_k_dense_replace", 0), n)
        mlp_types = ["dense"] * dense + ["sparse"] * (n - dense)
    mlp_types = list(mlp_types)[:n]
    sparse = tuple(i for i, t in enumerate(mlp_types) if t == "sparse")
    moe = None
    if sparse:
        moe = MoEConfig(
            num_experts=hf["n_routed_experts"],
            top_k=hf["num_experts_per_tok"],
            intermediate=hf["moe_intermediate_size"],
            router="sigmoid_topk",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_groups=hf.get("n_group") or 1,
            topk_groups=hf.get("topk_group") or 1,
            routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
            shared_intermediate=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
        )
    common = _common(hf, arch, kinds, where)
    common["head_dim"] = hf["qk_rope_head_dim"]  # only the rope slice is rotated
    kind = "mla" if arch == "DeepseekV3ForCausalLM" else "dsa"
    return ModelConfig(
        **common,
        **_rope_by_type(hf, where, 10000.0),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mla=_mla(hf, where, arch),
        moe=moe,
        sparse_layers=sparse,
        nextn=_nextn(nextn, kind, moe is not None, "deepseek", "num_nextn_predict_layers", where),
    )


def _nextn(count, kind: str, sparse: bool, style: str, key: str, where: str) -> NextNConfig | None:
    """The ``count`` multi-token-prediction blocks config.json's ``key`` claims (None for 0)."""
    if not isinstance(count, int) or count < 0:
        raise CheckpointError(f"{where}: {key} {count!r}: want a count >= 0")
    if not count:
        return None
    if style == "qwen" and count > 1:  # they would share mtp.fc and its norms
        raise CheckpointError(f"{where}: {key} {count}: more than one Qwen MTP layer is not supported")
    log.info(
        "%s: its %d multi-token-prediction block(s) (%s, a %s layer each) are loaded for drafting",
        where,
        count,
        key,
        kind,
    )
    return NextNConfig(num_layers=count, kind=kind, sparse=sparse, style=style)


V4_LAYER_KINDS = {
    "sliding_attention": "swa_mqa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


def deepseek_v4(hf: dict, where: str) -> ModelConfig:
    """DeepseekV4ForCausalLM: a sliding window of one K=V head in every layer, plus
    compressed entries in ``compressed_sparse_attention`` / ``heavily_compressed_attention``
    layers (``layer_types``, or the published configs' ``compress_ratios`` 0 / 4 / 128),
    ``hc_mult`` residual streams, and MoE in every layer: ``sqrtsoftplus`` scores with a
    correction bias, or in ``hash_moe`` layers (``mlp_layer_types``, or the first
    ``num_hash_layers``) experts chosen by token id. The ``num_nextn_predict_layers``
    multi-token-prediction blocks (``layers/mtp.py``) are built and loaded, for drafting; each
    block's layer kind is the entry past the last layer in ``layer_types`` /
    ``compress_ratios`` (the published Flash config's trailing 0: a sliding window), or a
    sliding window when the list stops at the last layer."""
    arch = hf["architectures"][0]
    _check(hf, where, hidden_act="silu", attention_bias=False, scoring_func="sqrtsoftplus")
    quant = hf.get("quantization_config")
    if quant and quant.get("quant_method") == "fp8":  # FP8 with E8M0 scales, FP4 experts
        fp8_blocks.check_config(quant, where)
    elif quant:
        raise CheckpointError(f"{where}: quantization {quant.get('quant_method')!r} is not supported (fp8)")
    n = hf["num_hidden_layers"]
    rates = dict(hf.get("compress_rates") or {})
    rates.setdefault("compressed_sparse_attention", hf.get("compress_rate_csa", 4))
    rates.setdefault("heavily_compressed_attention", hf.get("compress_rate_hca", 128))
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        by_ratio = {
            0: "sliding_attention",
            rates["compressed_sparse_attention"]: "compressed_sparse_attention",
        }
        by_ratio[rates["heavily_compressed_attention"]] = "heavily_compressed_attention"
        types = [by_ratio.get(r, f"compress ratio {r}") for r in hf["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA and HCA alternating
        types = ["heavily_compressed_attention"] * min(n, 2)
        types += [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(n - 2)
        ]
    nextn = hf.get("num_nextn_predict_layers", 0)
    types, mtp_type = list(types)[:n], (list(types)[n:] or ["sliding_attention"])[0]
    if mtp_type not in V4_LAYER_KINDS:
        want = sorted(V4_LAYER_KINDS)
        raise CheckpointError(
            f"{where}: the MTP layer's kind {mtp_type!r} (past layer {n}): want one of {want}"
        )
    bad = [t for t in types if t not in V4_LAYER_KINDS]
    if bad or len(types) != n:
        raise CheckpointError(f"{where}: layer_types {types!r}: want {n} of {sorted(V4_LAYER_KINDS)}")
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        hashed = min(n, hf.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * hashed + ["moe"] * (n - hashed)
    mlp_types = list(mlp_types)[:n]
    if any(t not in ("hash_moe", "moe") for t in mlp_types) or len(mlp_types) != n:
        raise CheckpointError(f"{where}: mlp_layer_types {mlp_types!r}: want {n} of 'hash_moe' / 'moe'")
    head_dim = hf["head_dim"]
    rot = hf.get("qk_rope_head_dim") or int(head_dim * float(hf.get("partial_rotary_factor") or 64 / 512))
    rope = hf.get("rope_parameters") or {}
    main = rope.get("main") or {"rope_theta": hf.get("rope_theta", 10000.0)}
    compress = rope.get("compress")
    if compress is None:  # a published config: YaRN (if any) at the top level, compress layers only
        compress = {
            k: v for k, v in (hf.get("rope_scaling") or rope).items() if k not in ("main", "compress")
        }
        compress["rope_theta"] = hf.get("compress_rope_theta", 160000.0)
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    if main.get("rope_type", "default") != "default":
        raise CheckpointError(f"{where}: rope_parameters.main.rope_type {main['rope_type']!r}: only default")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise CheckpointError(f"{where}: rope_parameters.compress.rope_type {kind!r}: default or yarn")
    yarn = _yarn(compress, hf, compress.get("truncate", True)) if kind == "yarn" else None
    v4 = Dsv4Config(
        q_lora_rank=hf["q_lora_rank"],
        o_groups=hf["o_groups"],
        o_lora_rank=hf["o_lora_rank"],
        qk_rope_head_dim=rot,
        csa_rate=int(rates["compressed_sparse_attention"]),
        hca_rate=int(rates["heavily_compressed_attention"]),
        compress_rope_theta=float(compress.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
        compress_yarn=yarn,
        index_n_heads=hf.get("index_n_heads", 0),
        index_head_dim=hf.get("index_head_dim", 0),
        index_topk=hf.get("index_topk", 0),
        hc_mult=hf.get("hc_mult", 4),
        hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
        hc_eps=float(hf.get("hc_eps", 1e-6)),
        hash_layers=tuple(i for i, t in enumerate(mlp_types) if t == "hash_moe"),
        num_nextn_predict_layers=nextn,
        mtp_kind=V4_LAYER_KINDS[mtp_type],
    )
    if nextn:
        log.info(
            "%s: its %d multi-token-prediction block(s) (mtp.<k>.*, a %s layer each) are loaded "
            "for drafting; the forward pass does not run them",
            where,
            nextn,
            mtp_type,
        )
    moe = MoEConfig(
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        intermediate=hf["moe_intermediate_size"],
        router="sqrtsoftplus_topk",
        norm_topk_prob=True,  # transformers' V4 routers always renormalise
        activation="silu_clamped",
        swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        shared_intermediate=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
    )
    common = _common({**hf, "intermediate_size": hf["moe_intermediate_size"]}, arch, (), where)
    common["layer_kinds"] = tuple(V4_LAYER_KINDS[t] for t in types)
    return ModelConfig(
        **common,
        rope_theta=float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
        partial_rotary_factor=rot / head_dim,
        sliding_window=hf["sliding_window"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_sinks=True,
        moe=moe,
        sparse_layers=tuple(range(n)),
        dsv4=v4,
    )
