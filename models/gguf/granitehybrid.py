"""llama.cpp's ``granitehybrid`` architecture, as its converter writes a ``BambaForCausalLM``.

``convert_hf_to_gguf.py`` registers ``BambaForCausalLM`` (and ``GraniteMoeHybridForCausalLM``)
in ``GraniteHybridModel(Mamba2Model, GraniteMoeModel)``. The facts this module relies on:

Metadata (``granitehybrid.*``):

- ``block_count``, ``context_length`` (``max_position_embeddings``; ``2**20`` when the model has
  no RoPE), ``embedding_length``, ``feed_forward_length`` (``intermediate_size``),
  ``attention.head_count``, ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``;
- ``attention.head_count_kv``: one entry per layer, ``num_key_value_heads`` for attention
  layers and 0 for Mamba2 layers (how llama.cpp tells the layer kinds apart);
- ``rope.dimension_count``: ``attn_rotary_emb`` when the config has it (Bamba's released
  configs do: half the head), else ``hidden_size // num_attention_heads``. There is no
  ``attention.key_length``: the Granite converter drops ``head_dim``, so a head is
  ``hidden_size // num_attention_heads`` wide;
- ``rope.scaling.finetuned``: true for Bamba (RoPE in its attention layers), false for hybrid
  Granite 4.0 models, whose attention layers have no position encoding;
- ``ssm.conv_kernel`` (``mamba_d_conv``), ``ssm.state_size`` (``mamba_d_state``),
  ``ssm.group_count`` (``mamba_n_groups``), ``ssm.inner_size`` (``mamba_expand *
  hidden_size``) and ``ssm.time_step_rank``, which holds the number of Mamba heads
  (``mamba_n_heads``), not a rank; a Mamba head is ``inner_size // time_step_rank`` wide;
- Granite multipliers, written only when the config has them (Bamba's has none):
  ``attention.scale`` (``attention_multiplier``, in place of ``head_dim ** -0.5``),
  ``embedding_scale``, ``residual_scale`` and ``logit_scale`` (``logits_scaling``, which
  divides the logits); MoE variants add ``expert_count``, ``expert_used_count`` and
  ``expert_shared_feed_forward_length``.

Not in the file: the SSD chunk size (the scan does not depend on it; transformers' default,
256, is used), ``time_step_limit`` (transformers' default, no limit), and the biases' flags,
which follow from which tensors exist. The vocabulary is padded to a multiple of 8 in the
token list only; ``token_embd`` keeps the checkpoint's rows.

Tensors (``blk.{i}.``; attention layers hold ``attn_*``, Mamba2 layers ``ssm_*``, every layer
``attn_norm``, ``ffn_norm`` and the dense MLP ``ffn_gate``/``ffn_up``/``ffn_down``):

- ``attn_q``/``attn_k``: rows of each head permuted from halves to interleaved pairs, as for
  ``llama`` (``undo_permute``), over the whole head even when RoPE covers part of it;
- ``ssm_a``: ``A = -exp(A_log)``, shape ``[n_heads, 1]``; ``ssm_d``: ``D`` as ``[n_heads, 1]``
  (neither has a ``.weight`` suffix); ``ssm_dt.bias``: ``dt_bias``;
- ``ssm_conv1d.weight``: the depthwise ``[C, 1, K]`` kernel squeezed to ``[C, K]``;
- ``ssm_norm.weight``: the gated RMSNorm's ``[d_inner]`` scale as ``[n_groups, d_inner /
  n_groups]``;
- MoE variants: ``ffn_gate_inp`` and ``ffn_{gate,up,down}_exps``, and the shared expert as
  ``ffn_*_shexp``.
"""

from __future__ import annotations

import math
import re

import numpy as np

from hicache_jax.models.hf.safetensors_io import CheckpointError

ARCH = "granitehybrid"
GLOBAL = {"model.embed_tokens": "token_embd", "model.final_layernorm": "output_norm", "lm_head": "output"}
LAYER = {
    "input_layernorm": "attn_norm",
    "pre_ff_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
    "mamba.in_proj": "ssm_in",
    "mamba.conv1d": "ssm_conv1d",
    "mamba.norm": "ssm_norm",
    "mamba.out_proj": "ssm_out",
}
# Parameters without a .weight/.bias suffix in transformers -> their full GGUF name in blk.{i}.
BARE = {"mamba.A_log": "ssm_a", "mamba.D": "ssm_d", "mamba.dt_bias": "ssm_dt.bias"}

_BIASED = ("ssm_in", "ssm_conv1d", "ssm_out")  # Bamba's other projections have no bias
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate_inp|(gate|up|down)_(exps|shexp))(\.\w+)?")
# Granite multipliers this project's Bamba does not apply: key -> neutral value (None: the
# attention scale, neutral at head_dim ** -0.5).
_NEUTRAL = {"embedding_scale": 1.0, "residual_scale": 1.0, "logit_scale": 1.0, "attention.scale": None}


def hf_fields(get, tensors: dict, hf: dict, theta, rope: dict, path: str) -> dict:
    """The Bamba ``config.json`` fields for a granitehybrid file's metadata (``get(key)`` reads
    ``granitehybrid.{key}``); what Bamba cannot express is an error naming it."""
    _refuse_unsupported(get, tensors, hf, path)
    layers, hidden, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    kv = get("attention.head_count_kv", heads)
    kv = [int(n) for n in kv] if isinstance(kv, list) else [int(kv)] * layers
    if len(kv) != layers:
        raise CheckpointError(
            f"{path}: {ARCH}.attention.head_count_kv has {len(kv)} entries for {layers} layers"
        )
    attn = [i for i, n in enumerate(kv) if n]
    if len({kv[i] for i in attn}) > 1:
        raise CheckpointError(
            f"{path}: {ARCH}.attention.head_count_kv {kv}: attention layers with different "
            "KV head counts are not supported"
        )
    head_dim = int(get("attention.key_length") or hidden // heads)
    rotary = int(get("rope.dimension_count") or head_dim)
    inner = int(get("ssm.inner_size", required=True))
    mamba_heads = int(get("ssm.time_step_rank", required=True))
    if inner % mamba_heads or inner % hidden:
        raise CheckpointError(
            f"{path}: {ARCH}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
            f"{mamba_heads} (Mamba heads) and of embedding_length {hidden}"
        )
    first = next((i for i in range(layers) if i not in attn), None)  # a Mamba2 layer
    return {
        "hidden_act": "silu",
        "num_key_value_heads": kv[attn[0]] if attn else heads,
        "head_dim": head_dim,
        "attn_layer_indices": attn,
        "rope_parameters": {
            **rope,
            "rope_theta": float(theta or 10000.0),
            "partial_rotary_factor": rotary / head_dim,
        },
        "mamba_n_heads": mamba_heads,
        "mamba_d_head": inner // mamba_heads,
        "mamba_expand": inner // hidden,
        "mamba_d_state": int(get("ssm.state_size", required=True)),
        "mamba_n_groups": int(get("ssm.group_count", 1)),
        "mamba_d_conv": int(get("ssm.conv_kernel", required=True)),
        "mamba_conv_bias": _has(tensors, first, "ssm_conv1d.bias"),
        "mamba_proj_bias": _has(tensors, first, "ssm_in.bias"),
    }


def _has(tensors: dict, layer: int | None, name: str) -> bool:
    return layer is not None and f"blk.{layer}.{name}" in tensors


def _refuse_unsupported(get, tensors: dict, hf: dict, path: str) -> None:
    experts = sorted(n for n in tensors if _EXPERTS.fullmatch(n))
    if experts or int(get("expert_count", 0) or 0):
        raise CheckpointError(
            f"{path}: {ARCH} mixture-of-experts layers ({_some(experts) or f'{ARCH}.expert_count'}) are "
            "not supported; only Bamba's dense MLP is"
        )
    known = {f"{g}.weight" for g in GLOBAL.values()}
    for i in range(hf["num_hidden_layers"]):
        known |= {f"blk.{i}.{g}.weight" for g in LAYER.values()}
        known |= {f"blk.{i}.{g}.bias" for g in _BIASED} | {f"blk.{i}.{g}" for g in BARE.values()}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise CheckpointError(f"{path}: {ARCH} tensors {_some(unknown)} are not part of Bamba; not supported")
    if not bool(get("rope.scaling.finetuned", True)):
        raise CheckpointError(
            f"{path}: {ARCH}.rope.scaling.finetuned is false: attention without RoPE (as in "
            "Granite 4.0 hybrids) is not supported; only Bamba's RoPE attention is"
        )
    head_dim = int(get("attention.key_length") or hf["hidden_size"] // hf["num_attention_heads"])
    for key, neutral in _NEUTRAL.items():
        value = get(key)
        want = head_dim**-0.5 if neutral is None else neutral
        if value is not None and not math.isclose(float(value), want, rel_tol=1e-6):
            raise CheckpointError(
                f"{path}: {ARCH}.{key} = {float(value):g} is not supported (Granite multiplier; "
                f"only the neutral {want:g}, as in Bamba)"
            )


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def undo(name: str, w: np.ndarray) -> np.ndarray:
    """A granitehybrid SSM tensor (numpy shape) as transformers' Bamba holds it. The q/k row
    order is undone by the caller, as for ``llama``."""
    if name.endswith(".ssm_a"):
        if np.any(w >= 0):
            raise CheckpointError("has entries >= 0; expected A = -exp(A_log) < 0")
        return np.log(-w.astype(np.float64)).astype(np.float32).reshape(-1)
    if name.endswith(".ssm_d"):
        return w.reshape(-1)
    if name.endswith(".ssm_conv1d.weight"):
        if w.ndim != 2:
            raise CheckpointError(f"has shape {w.shape}, expected [channels, kernel]")
        return w[:, None, :]
    if name.endswith(".ssm_norm.weight"):
        return w.reshape(-1)
    return w
