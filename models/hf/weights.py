"""Hugging Face tensor names <-> this package's parameter paths, and checkpoint loading."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hicache_jax.kinds import LayerKind
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.hf import fp8_blocks, mxfp4
from hicache_jax.models.hf.safetensors_io import Checkpoint, CheckpointError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HFNames:
    """Where an architecture keeps the tensors whose names differ between families. Module
    names are relative to a layer's prefix (``{layers}.{i}``)."""

    final_norm: str = "model.norm"
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    input_norm: str = "input_layernorm"
    pre_mlp_norm: str | None = "post_attention_layernorm"
    post_mixer_norm: str | None = None
    post_mlp_norm: str | None = None
    attention: str = "self_attn"
    mamba: str = "mamba"
    mlp: str = "mlp"
    # The dense MLP (and shared expert) as Granite stores it: ``input_linear`` (gate rows,
    # then up rows) and ``output_linear``, in place of ``{gate,up,down}_proj``.
    fused_mlp: bool = False
    # MoE layers: the module holding router and experts, and how the experts are stored:
    # "per_expert" (Qwen3-MoE, Nemotron-H: ``gate`` and ``experts.<e>.*_proj``), "fused"
    # (gpt-oss: ``router`` and ``experts.{gate_up,down}_proj[_bias]``, gate and up
    # interleaved; bf16 or MXFP4 ``_blocks`` / ``_scales``) or "granite" (``router.layer``,
    # ``input_linear [E, 2I, H]`` and ``output_linear [E, H, I]``).
    moe: str = "mlp"
    experts: str = "per_expert"
    shared_expert: str = "mlp.shared_expert"
    shared_expert_gate: str = "mlp.shared_expert_gate"
    # Nemotron-H: every checkpoint layer is one block, a mixer or an MLP; ours pairs them
    # (``hf_config.nemotron_h_layers``), so our layer ``i`` reads the mixer and its norm
    # from block ``hf_blocks(cfg)[i]`` and the MLP and its norm from the block after.
    blocks: bool = False
    # Gated DeltaNet in-projections: "split" (Qwen3.5: ``in_proj_qkv``, ``in_proj_z``,
    # ``in_proj_b``, ``in_proj_a``) or "fused" (Qwen3-Next: ``in_proj_qkvz``, ``in_proj_ba``,
    # grouped by key head).
    gdn_proj: str = "split"
    # DeepSeek V4: the checkpoint's own names (``attn.wq_a``, ``ffn.experts.<e>.w1`` ...),
    # as published and as transformers' save_pretrained writes them (``_dsv4_tensor``).
    dsv4: bool = False


LLAMA_NAMES = HFNames()
GPT_OSS_NAMES = HFNames(experts="fused")
GEMMA3_NAMES = HFNames(
    pre_mlp_norm="pre_feedforward_layernorm",
    post_mixer_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)
OLMO3_NAMES = HFNames(
    pre_mlp_norm=None, post_mixer_norm="post_attention_layernorm", post_mlp_norm="post_feedforward_layernorm"
)
BAMBA_NAMES = HFNames(final_norm="model.final_layernorm", pre_mlp_norm="pre_ff_layernorm", mlp="feed_forward")
NEMOTRON_H_NAMES = HFNames(
    final_norm="backbone.norm_f",
    embed="backbone.embeddings",
    layers="backbone.layers",
    input_norm="norm",
    pre_mlp_norm="norm",
    attention="mixer",
    mamba="mixer",
    mlp="mixer",
    moe="mixer",
    shared_expert="mixer.shared_experts",
    blocks=True,
)
GRANITE_H_NAMES = HFNames(
    mlp="shared_mlp", fused_mlp=True, moe="block_sparse_moe", experts="granite", shared_expert="shared_mlp"
)

QWEN3_NEXT_NAMES = HFNames(gdn_proj="fused")
DEEPSEEK_NAMES = HFNames(shared_expert="mlp.shared_experts")
DEEPSEEK_V4_NAMES = HFNames(dsv4=True)
# The text model inside a multimodal checkpoint (Qwen3.5's published ones).
QWEN3_5_VL_NAMES = HFNames(
    final_norm="model.language_model.norm",
    embed="model.language_model.embed_tokens",
    layers="model.language_model.layers",
)


def hf_blocks(cfg: ModelConfig) -> tuple[int, ...]:
    """Nemotron-H: the checkpoint block of each of our layers' mixer (its MLP, if it has
    one, is the next block)."""
    out, block = [], 0
    for i in range(cfg.num_layers):
        out.append(block)
        block += 1 if i in cfg.mlp_free_layers else 2
    return tuple(out)


def _t(a):  # torch Linear [out, in] -> kernel [in, out]
    return a.T


def _conv(a):  # Conv1d depthwise [C, 1, K] -> [K, C]
    if a.ndim != 3 or a.shape[1] != 1:
        raise ValueError(f"expected a depthwise conv weight [C, 1, K], got {a.shape}")
    return a[:, 0, :].T


def _same(a):
    return a


def _t_gate(a):  # Granite's input_linear [2I, H]: gate rows, then up -> gate kernel [H, I]
    return a[: a.shape[0] // 2].T


def _t_up(a):
    return a[a.shape[0] // 2 :].T


@dataclasses.dataclass(frozen=True)
class Joined:
    """A parameter made from several checkpoint tensors (or one, rearranged):
    ``combine(*tensors)`` gives our layout."""

    parts: tuple[str, ...]
    combine: Callable

    @property
    def name(self) -> str:
        return "|".join(self.parts)  # for messages


def _gdn_groups(cfg: ModelConfig, *blocks) -> np.ndarray:
    """Rows of a Gated DeltaNet projection or conv regrouped by key head: each block
    ``[num_k_heads * w, ...]`` is split into the heads' ``w`` rows, and every head's rows of
    every block follow each other (``layers/gated_deltanet.py``'s layout)."""
    nk = cfg.gdn.num_k_heads
    parts = [b.reshape(nk, b.shape[0] // nk, *b.shape[1:]) for b in blocks]
    out = np.concatenate(parts, axis=1)
    return out.reshape(-1, *out.shape[2:])


def _gdn_tensor(names: HFNames, cfg: ModelConfig, m: str, leaf: tuple):
    """A Gated DeltaNet layer's tensor (``m``: its ``linear_attn`` prefix)."""
    g = cfg.gdn
    kd = g.key_dim
    if leaf[0] == "in_proj":
        if names.gdn_proj == "fused":  # already grouped by key head: [q k v z] and [b a]
            combine = lambda qkvz, ba: _gdn_groups(cfg, qkvz, ba).T  # noqa: E731
            return Joined((f"{m}.in_proj_qkvz.weight", f"{m}.in_proj_ba.weight"), combine), _same

        def combine(qkv, z, b, a):  # [q | k | v] heads in order, then z, b and a
            return _gdn_groups(cfg, qkv[:kd], qkv[kd : 2 * kd], qkv[2 * kd :], z, b, a).T

        parts = tuple(f"{m}.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a"))
        return Joined(parts, combine), _same
    if leaf[0] == "conv_weight":  # depthwise [C, 1, K] over [q | k | v] -> [K, C] grouped

        def conv(w):
            c = _conv(w).T  # [C, K]
            return _gdn_groups(cfg, c[:kd], c[kd : 2 * kd], c[2 * kd :]).T

        return Joined((f"{m}.conv1d.weight",), conv), _same
    if leaf[0] == "out_proj":
        return f"{m}.out_proj.weight", _t
    if leaf[0] == "norm":
        return f"{m}.norm.weight", _same
    return f"{m}.{leaf[0]}", _same  # dt_bias, A_log


@dataclasses.dataclass(frozen=True)
class Experts:
    """An MoE weight read expert by expert: ``parts`` names the checkpoint tensors behind it
    (``<e>`` stands for the expert's number, else each tensor holds every expert on its first
    axis) and ``combine`` turns expert ``e``'s parts into its slice of our ``[E, ...]``."""

    num_experts: int
    parts: tuple[str, ...]
    combine: Callable

    @property
    def name(self) -> str:
        return "|".join(self.parts)  # for messages

    def read(self, ckpt, e: int) -> list:
        if "<e>" in self.parts[0]:
            return [ckpt.get(n.replace("<e>", str(e))) for n in self.parts]
        return [ckpt.get(n)[e] for n in self.parts]


class ExpertStack:
    """``Experts`` read lazily from a checkpoint: indexing reads only the experts it needs
    (a device of an expert-parallel mesh, only its own)."""

    def __init__(self, ckpt, experts: Experts):
        self.ckpt, self.experts = ckpt, experts
        self.shape = ()
        if "<e>" not in experts.parts[0]:
            for n in experts.parts:
                shape = tuple(ckpt.get(n).shape)
                if shape[0] != experts.num_experts:
                    want = experts.num_experts
                    raise CheckpointError(f"tensor {n} has shape {shape}: expected {want} experts first")
        first = self._one(0)
        self.shape = (experts.num_experts,) + first.shape
        self.dtype = first.dtype

    def _one(self, e: int) -> np.ndarray:
        raws = self.experts.read(self.ckpt, e)
        try:
            out = np.asarray(self.experts.combine(*raws))
        except ValueError as err:
            raise CheckpointError(f"expert {e}: {err}") from err
        if e and out.shape != self.shape[1:]:
            shapes = ", ".join(f"{n} {tuple(r.shape)}" for n, r in zip(self.experts.parts, raws))
            raise CheckpointError(f"expert {e} has {shapes}; expert 0's make {self.shape[1:]}")
        return out

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        chosen = range(self.experts.num_experts)[index[0]]
        return np.stack([self._one(e) for e in chosen])[(slice(None),) + index[1:]]

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def _halves(a):  # gate and up interleaved on the last axis -> gate half, then up half
    return np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)


def _mlp_tensor(names: HFNames, module: str, proj: str):
    """A dense MLP's (or shared expert's) projection ``proj`` in checkpoint ``module``."""
    if not names.fused_mlp:
        return f"{module}.{proj}.weight", _t
    if proj == "down_proj":
        return f"{module}.output_linear.weight", _t
    return f"{module}.input_linear.weight", _t_gate if proj == "gate_proj" else _t_up


def _kv_b_half(cfg: ModelConfig, half: str):
    """MLA's ``kv_b_proj`` weight -> W_UK ``[H, nope, L]`` or W_UV ``[H, L, v]``."""
    m, H = cfg.mla, cfg.num_heads

    def split(w):
        w = w.reshape(H, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim] if half == "w_uk" else w[:, m.qk_nope_head_dim :].transpose(0, 2, 1)

    return split


def _moe_tensor(names: HFNames, pre: str, leaf: tuple, cfg: ModelConfig, ckpt):
    """An MoE layer's tensor: the router (a Linear), its correction bias, the shared expert
    or an ``Experts``."""
    E = cfg.moe.num_experts
    moe = f"{pre}.{names.moe}"
    if leaf[0] == "shared_expert":
        return _mlp_tensor(names, f"{pre}.{names.shared_expert}", leaf[1])
    if leaf[0] == "shared_expert_gate":
        return f"{pre}.{names.shared_expert_gate}.weight", _t
    if leaf[0] == "score_correction_bias":
        return f"{moe}.gate.e_score_correction_bias", _same
    if names.experts == "per_expert":  # Qwen3-MoE; Nemotron-H's experts have no gate_proj
        if leaf[0] == "router":
            return f"{moe}.gate.weight", _t
        stacked = f"{moe}.experts.{'gate_up_proj' if leaf[0] == 'gate_up' else 'down_proj'}"
        if ckpt is not None and stacked in ckpt:  # transformers 5's own layout: [E, 2I, H], [E, H, I]
            return Experts(E, (stacked,), lambda a: a.T), _same
        e = f"{moe}.experts.<e>"
        if leaf[0] == "gate_up" and not cfg.moe.gated:
            return Experts(E, (f"{e}.up_proj.weight",), lambda u: u.T), _same
        if leaf[0] == "gate_up":
            parts = (f"{e}.gate_proj.weight", f"{e}.up_proj.weight")
            return Experts(E, parts, lambda g, u: np.concatenate([g.T, u.T], axis=-1)), _same
        if leaf[0] == "down":
            return Experts(E, (f"{e}.down_proj.weight",), lambda d: d.T), _same
        raise KeyError(leaf)
    if names.experts == "granite":  # every expert in one tensor, gate rows then up rows
        if leaf[0] == "router":
            return f"{moe}.router.layer.weight", _t
        name = {"gate_up": "input_linear", "down": "output_linear"}[leaf[0]]
        return Experts(E, (f"{moe}.{name}.weight",), lambda a: a.T), _same
    # gpt-oss: fused tensors, gate and up interleaved; the projections in bf16 or MXFP4.
    if leaf[0] == "router":
        return f"{moe}.router.{'weight' if leaf[1] == 'kernel' else 'bias'}", _t
    name = {"gate_up": "gate_up_proj", "down": "down_proj", "gate_up_bias": "gate_up_proj_bias",
            "down_bias": "down_proj_bias"}[leaf[0]]  # fmt: skip
    full = f"{moe}.experts.{name}"
    interleaved = leaf[0].startswith("gate_up")
    if leaf[0].endswith("bias") or ckpt is None or full in ckpt or f"{full}_blocks" not in ckpt:
        return Experts(E, (full,), _halves if interleaved else _same), _same
    dequantized = mxfp4.dequantize_weight
    if interleaved:
        dequantized = lambda b, s: _halves(mxfp4.dequantize_weight(b, s))  # noqa: E731
    return Experts(E, (f"{full}_blocks", f"{full}_scales"), dequantized), _same


# DeepSeek V4: our module path -> the checkpoint's module name, in a layer.
_DSV4_MODULES = {
    ("attn_hc",): "hc_attn_",
    ("ffn_hc",): "hc_ffn_",
    ("input_norm",): "attn_norm",
    ("pre_mlp_norm",): "ffn_norm",
    ("mixer", "q_a_proj"): "attn.wq_a",
    ("mixer", "q_a_norm"): "attn.q_norm",
    ("mixer", "q_b_proj"): "attn.wq_b",
    ("mixer", "kv_proj"): "attn.wkv",
    ("mixer", "kv_norm"): "attn.norm",
    ("mixer", "o_b_proj"): "attn.wo_b",
    ("mixer", "compressor", "kv_proj"): "attn.compressor.wkv",
    ("mixer", "compressor", "gate_proj"): "attn.compressor.wgate",
    ("mixer", "compressor", "kv_norm"): "attn.compressor.norm",
    ("mixer", "indexer", "kv_proj"): "attn.indexer.compressor.wkv",
    ("mixer", "indexer", "gate_proj"): "attn.indexer.compressor.wgate",
    ("mixer", "indexer", "kv_norm"): "attn.indexer.compressor.norm",
    ("mixer", "index_q_b_proj"): "attn.indexer.wq_b",
    ("mixer", "index_weights_proj"): "attn.indexer.weights_proj",
    ("mlp", "router"): "ffn.gate",
    ("mlp", "shared_expert", "gate_proj"): "ffn.shared_experts.w1",
    ("mlp", "shared_expert", "up_proj"): "ffn.shared_experts.w3",
    ("mlp", "shared_expert", "down_proj"): "ffn.shared_experts.w2",
}
_DSV4_LEAVES = {
    ("mixer", "sinks"): "attn.attn_sink",
    ("mixer", "compressor", "position_bias"): "attn.compressor.ape",
    ("mixer", "indexer", "position_bias"): "attn.indexer.compressor.ape",
    ("mlp", "score_correction_bias"): "ffn.gate.bias",
    ("mlp", "tid2eid"): "ffn.gate.tid2eid",
}


# A multi-token-prediction block's own tensors (``mtp.<k>.`` + these; its layer's are named
# as a main layer's). transformers has no MTP module (it ignores ``mtp.*`` on load and
# writes none), so the published names are the only ones.
_DSV4_MTP = {
    ("enorm", "weight"): ("enorm.weight", _same),
    ("hnorm", "weight"): ("hnorm.weight", _same),
    ("norm", "weight"): ("norm.weight", _same),
    ("e_proj", "kernel"): ("e_proj.weight", _t),
    ("h_proj", "kernel"): ("h_proj.weight", _t),
    ("head", "hc_fn"): ("hc_head_fn", _same),
    ("head", "hc_base"): ("hc_head_base", _same),
    ("head", "hc_scale"): ("hc_head_scale", _same),
}


def _dsv4_tensor(cfg: ModelConfig, p: tuple, ckpt) -> tuple:
    """A DeepSeek V4 parameter's tensor. The published checkpoints name layers
    ``layers.<i>`` (``embed``, ``head``, ``hc_head_fn``) and MTP blocks ``mtp.<k>``;
    transformers' save_pretrained writes ``model.layers.<i>`` (``model.embed_tokens``,
    ``model.hc_head.hc_fn``) and no MTP block."""
    nested = ckpt is None or "embed.weight" not in ckpt
    top = {
        ("embed", "embedding"): "model.embed_tokens.weight" if nested else "embed.weight",
        ("lm_head", "kernel"): "head.weight",
        ("final_norm", "weight"): "model.norm.weight" if nested else "norm.weight",
    }
    if p in top:
        return top[p], _t if p[0] == "lm_head" else _same
    if p[0] == "hc_head":
        return (f"model.hc_head.{p[1]}" if nested else f"hc_head_{p[1][3:]}"), _same
    if p[0] == "mtp":
        if p[2] != "layer":
            name, transform = _DSV4_MTP[p[2:]]
            return f"mtp.{p[1]}.{name}", transform
        return _dsv4_layer_tensor(cfg, f"mtp.{p[1]}", p[3:], ckpt)
    return _dsv4_layer_tensor(cfg, f"{'model.' if nested else ''}layers.{p[1]}", p[2:], ckpt)


def _dsv4_layer_tensor(cfg: ModelConfig, pre: str, rest: tuple, ckpt) -> tuple:
    """A V4 decoder layer's tensor, the layer's names starting ``pre``."""
    *module, leaf = rest
    module = tuple(module)
    if module == ("mixer", "kv_norm") and ckpt is not None and f"{pre}.attn.kv_norm.weight" in ckpt:
        return f"{pre}.attn.kv_norm.weight", _same  # as published; transformers writes attn.norm
    if (*module, leaf) in _DSV4_LEAVES:
        return f"{pre}.{_DSV4_LEAVES[(*module, leaf)]}", _same
    if module in (("attn_hc",), ("ffn_hc",)):
        return f"{pre}.{_DSV4_MODULES[module]}{leaf}", _same
    if module == ("mixer",) and leaf == "o_a":  # wo_a [groups * o_lora, in]: a block per group
        G = cfg.dsv4.o_groups
        return Joined(
            (f"{pre}.attn.wo_a.weight",), lambda w: w.reshape(G, -1, w.shape[1]).transpose(0, 2, 1)
        ), _same
    if module == ("mlp",) and leaf in ("gate_up", "down"):
        e = f"{pre}.ffn.experts.<e>"
        if leaf == "down":
            return Experts(cfg.moe.num_experts, (f"{e}.w2.weight",), lambda d: d.T), _same
        parts = (f"{e}.w1.weight", f"{e}.w3.weight")
        return Experts(cfg.moe.num_experts, parts, lambda g, u: np.concatenate([g.T, u.T], axis=-1)), _same
    name = f"{pre}.{_DSV4_MODULES[module]}"
    return (f"{name}.weight", _t) if leaf == "kernel" else (f"{name}.{leaf}", _same)


def hf_tensor(names: HFNames, cfg: ModelConfig, path: tuple, ckpt=None) -> tuple[str, callable]:
    """The HF tensor (and the transform to our layout) behind one parameter path."""
    p = tuple(str(x) for x in path)
    if names.dsv4:
        return _dsv4_tensor(cfg, p, ckpt)
    if p == ("embed", "embedding"):
        return f"{names.embed}.weight", _same
    if p == ("lm_head", "kernel"):
        return "lm_head.weight", _t
    if p == ("final_norm", "weight"):
        return f"{names.final_norm}.weight", _same
    if p[0] == "mtp":
        return _nextn_tensor(names, cfg, p, ckpt)
    if p[0] != "layers":
        raise KeyError(path)
    i, rest = int(p[1]), p[2:]
    if names.blocks:  # the mixer's block, then the MLP's (see HFNames.blocks)
        pre = f"{names.layers}.{hf_blocks(cfg)[i]}"
        mlp_pre = f"{names.layers}.{hf_blocks(cfg)[i] + 1}"
    else:
        pre = mlp_pre = f"{names.layers}.{i}"
    return _layer_tensor(names, cfg, pre, mlp_pre, cfg.layer_kinds[i], i in cfg.sparse_layers, rest, ckpt)


def _layer_tensor(names: HFNames, cfg: ModelConfig, pre: str, mlp_pre: str, kind, sparse: bool, rest, ckpt):
    """A decoder layer's tensor: its mixer and norm named from ``pre``, its MLP's from
    ``mlp_pre``; ``rest`` the parameter's path in the layer."""
    norm = {
        "input_norm": (pre, names.input_norm),
        "pre_mlp_norm": (mlp_pre, names.pre_mlp_norm),
        "post_mixer_norm": (pre, names.post_mixer_norm),
        "post_mlp_norm": (mlp_pre, names.post_mlp_norm),
    }
    if rest[0] in norm:
        block, name = norm[rest[0]]
        return f"{block}.{name}.weight", _same
    if rest[0] == "mlp":
        if sparse:
            return _moe_tensor(names, mlp_pre, rest[1:], cfg, ckpt)
        return _mlp_tensor(names, f"{mlp_pre}.{names.mlp}", rest[1])
    assert rest[0] == "mixer", rest
    if kind == LayerKind.GDN:
        return _gdn_tensor(names, cfg, f"{pre}.linear_attn", rest[1:])
    if kind in (LayerKind.MLA, LayerKind.DSA, LayerKind.DSA_SHARED):  # transformers' module names
        if rest[1] in ("w_uk", "w_uv"):  # kv_b_proj [H * (nope + v), L], split head-major
            return Joined((f"{pre}.{names.attention}.kv_b_proj.weight",), _kv_b_half(cfg, rest[1])), _same
        *modules, leaf = rest[1:]
        t = f"{pre}.{names.attention}.{'.'.join(modules)}"
        if leaf == "kernel":
            return f"{t}.weight", _t
        return f"{t}.{leaf}", _same  # norms' weight, biases
    if kind != LayerKind.MAMBA:
        a = f"{pre}.{names.attention}"
        if rest[1] in ("q_norm", "k_norm"):
            return f"{a}.{rest[1]}.weight", _same
        if rest[1] == "sinks":
            return f"{a}.sinks", _same
        return f"{a}.{rest[1]}.{'weight' if rest[2] == 'kernel' else 'bias'}", _t
    m = f"{pre}.{names.mamba}"
    if rest[1] in ("in_proj", "out_proj"):
        return (f"{m}.{rest[1]}.weight", _t) if rest[2] == "kernel" else (f"{m}.{rest[1]}.bias", _same)
    if rest[1] == "conv_weight":
        return f"{m}.conv1d.weight", _conv
    if rest[1] == "conv_bias":
        return f"{m}.conv1d.bias", _same
    if rest[1] == "norm":
        return f"{m}.norm.weight", _same
    return f"{m}.{rest[1]}", _same  # dt_bias, A_log, D


# A ``NextNConfig`` block's own tensors: our path -> (DeepSeek's name, Qwen's name), after
# the block's prefix (``nextn_prefix``); its layer's are named as a main layer's.
_NEXTN = {
    ("enorm", "weight"): ("enorm.weight", "pre_fc_norm_embedding.weight"),
    ("hnorm", "weight"): ("hnorm.weight", "pre_fc_norm_hidden.weight"),
    ("norm", "weight"): ("shared_head.norm.weight", "norm.weight"),
    ("proj", "kernel"): ("eh_proj.weight", "fc.weight"),
    ("head", "kernel"): ("shared_head.head.weight", None),
}


def nextn_prefix(names: HFNames, cfg: ModelConfig, k: int) -> tuple[str, str]:
    """Block ``k``'s prefix and its layer's: DeepSeek's blocks are the checkpoint's layers
    past the main ones (``model.layers.<num_layers + k>``), Qwen's are under ``mtp.``."""
    if cfg.nextn.style == "deepseek":
        pre = f"{names.layers}.{cfg.num_layers + k}"
        return pre, pre
    return "mtp", f"mtp.layers.{k}"


def _nextn_tensor(names: HFNames, cfg: ModelConfig, p: tuple, ckpt) -> tuple:
    if cfg.nextn is None:
        raise KeyError(p)
    pre, layer = nextn_prefix(names, cfg, int(p[1]))
    rest = p[2:]
    if rest[0] == "layer":
        x = cfg.nextn
        return _layer_tensor(names, cfg, layer, layer, x.kind, x.sparse, rest[1:], ckpt)
    name = _NEXTN[rest][0 if cfg.nextn.style == "deepseek" else 1]
    return f"{pre}.{name}", (_t if rest[-1] == "kernel" else _same)


def load_params(ckpt: Checkpoint, names: HFNames, cfg: ModelConfig, abstract_state, dtype, sharding=None):
    """Fill an abstract nnx.State from the checkpoint, checking every tensor.

    ``sharding(keypath, leaf)`` places each leaf on a mesh: every device then reads only
    its own slice of the memory-mapped tensor (a process, only its devices' slices).
    Block-scaled FP8 weights (``fp8_blocks``) read dequantized, to float32."""
    ckpt = fp8_blocks.Dequantized(ckpt)

    def load(kp, leaf):
        path = tuple(_key(k) for k in kp)
        name, transform = hf_tensor(names, cfg, path, ckpt)
        if isinstance(name, Joined):
            return _place(_joined(ckpt, name, leaf.shape), leaf, kp)
        if isinstance(name, Experts):
            where = ckpt.file_of(name.parts[0].replace("<e>", "0"))
            try:
                raw = ExpertStack(ckpt, name)
            except ValueError as e:
                raise CheckpointError(f"{where}: tensors {name.name}: {e}") from e
            name = name.name
        else:
            where = ckpt.file_of(name)
            raw = ckpt.get(name)
        if jnp.issubdtype(leaf.dtype, jnp.integer):  # a lookup table (DeepSeek V4's tid2eid)
            if not np.issubdtype(raw.dtype, np.integer):
                raise CheckpointError(f"{where}: tensor {name} has dtype {raw.dtype}, expected integers")
        elif not (np.issubdtype(raw.dtype, np.floating) or raw.dtype == jnp.bfloat16):
            raise CheckpointError(f"{where}: tensor {name} has dtype {raw.dtype}, expected a float type")
        try:
            arr = transform(raw)
        except ValueError as e:
            raise CheckpointError(f"{where}: tensor {name}: {e}") from e
        if arr.shape != leaf.shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(raw.shape)}, "
                f"expected {expected_hf_shape(transform, leaf.shape)}"
            )
        return _place(arr, leaf, kp)

    def _place(arr, leaf, kp):
        want = leaf.dtype if jnp.issubdtype(leaf.dtype, jnp.integer) else dtype
        if sharding is None:
            return jnp.asarray(np.asarray(arr), dtype=want)
        np_dtype = jnp.dtype(want)
        return jax.make_array_from_callback(
            leaf.shape, sharding(kp, leaf), lambda index: np.asarray(arr[index], dtype=np_dtype)
        )

    if names.dsv4:
        _check_all_read(ckpt, names, cfg, abstract_state)
    else:
        _check_nextn(ckpt, names, cfg, abstract_state)
    return jax.tree_util.tree_map_with_path(load, abstract_state)


def _read_names(names: HFNames, cfg: ModelConfig, abstract_state, ckpt, under: str = "") -> set:
    """The checkpoint names the parameters under ``under`` (a path's first key) read, with
    their FP8 scales."""
    read = set()
    for kp, _ in jax.tree_util.tree_leaves_with_path(abstract_state):
        path = tuple(_key(k) for k in kp)
        if under and str(path[0]) != under:
            continue
        name, _ = hf_tensor(names, cfg, path, ckpt)
        parts = name.parts if isinstance(name, (Joined, Experts)) else (name,)
        if isinstance(name, Experts) and "<e>" in parts[0]:
            parts = [n.replace("<e>", str(e)) for n in parts for e in range(name.num_experts)]
        for n in parts:
            read.update((n, *fp8_blocks.scale_names(n)))
    return read


def _mtp_held(names: HFNames, cfg: ModelConfig, held) -> tuple[list, str]:
    """The checkpoint's multi-token-prediction tensors (DeepSeek's: layers past the main
    ones; Qwen's: ``mtp.*``) and the config.json key counting them."""
    if cfg.architecture.startswith(("Deepseek", "Glm")):
        layers = f"{names.layers}."
        past = [
            n for n in held if n.startswith(layers) and int(n[len(layers) :].split(".")[0]) >= cfg.num_layers
        ]
        return past, "num_nextn_predict_layers"
    if cfg.gdn is not None:
        return [n for n in held if n.startswith("mtp.")], "mtp_num_hidden_layers"
    return [], ""


def _check_nextn(ckpt, names: HFNames, cfg: ModelConfig, abstract_state) -> None:
    """The checkpoint's MTP tensors against the config's ``NextNConfig``: refuse blocks the
    config counts but the checkpoint lacks, or MTP tensors no parameter reads (naming them);
    a DeepSeek block's copy of the embedding must equal the model's. MTP tensors of a config
    that counts no block are left unread (config.json's count set to 0 skips them)."""
    held, key = _mtp_held(names, cfg, ckpt.names())
    count = cfg.nextn.num_layers if cfg.nextn is not None else 0
    if not count:
        if held:
            log.info("%s: %d MTP tensor(s) left unread (%s 0)", ckpt.file_of(held[0]), len(held), key)
        return
    if not held:
        first = ckpt.names()[0]
        raise CheckpointError(
            f"{os.path.dirname(ckpt.file_of(first))}: config.json has {key} {count} but the "
            "checkpoint holds none of their tensors (transformers' save_pretrained writes none): "
            "set it to 0 to load the model without its multi-token-prediction blocks"
        )
    read = _read_names(names, cfg, abstract_state, ckpt, under="mtp")
    for k in range(count):
        copy = f"{nextn_prefix(names, cfg, k)[0]}.embed_tokens.weight"
        if cfg.nextn.style == "deepseek" and copy in ckpt:
            main = f"{names.embed}.weight"
            if not np.array_equal(np.asarray(ckpt.get(copy)), np.asarray(ckpt.get(main))):
                raise CheckpointError(
                    f"{ckpt.file_of(copy)}: tensor {copy} differs from {main}: an MTP block with "
                    f"its own embedding is not supported (set {key} to 0 to load without it)"
                )
            read.add(copy)
    left = sorted(set(held) - read)
    if left:
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        raise CheckpointError(
            f"{ckpt.file_of(left[0])}: {len(left)} MTP tensor(s) no parameter reads: {shown} ({key} {count})"
        )


def _check_all_read(ckpt, names: HFNames, cfg: ModelConfig, abstract_state) -> None:
    """Refuse a checkpoint holding tensors no parameter reads (a DeepSeek V4 MTP block the
    config does not count, say), naming them: none is dropped silently."""
    nextn, held = cfg.dsv4.num_nextn_predict_layers, ckpt.names()
    if nextn and not any(n.startswith("mtp.") for n in held):
        raise CheckpointError(
            f"{os.path.dirname(ckpt.file_of(held[0]))}: config.json has num_nextn_predict_layers {nextn} "
            "but the checkpoint holds no mtp.* tensor (transformers' save_pretrained writes none): "
            "set it to 0 to load the model without its multi-token-prediction blocks"
        )
    read = _read_names(names, cfg, abstract_state, ckpt)
    left = sorted(set(held) - read)
    if left:
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        raise CheckpointError(
            f"{ckpt.file_of(left[0])}: {len(left)} tensor(s) no parameter reads: {shown} "
            f"(num_nextn_predict_layers {cfg.dsv4.num_nextn_predict_layers} in config.json)"
        )


def _joined(ckpt: Checkpoint, joined: Joined, shape: tuple) -> np.ndarray:
    """Read and combine a ``Joined`` parameter's tensors, checking each and the result."""
    where = ckpt.file_of(joined.parts[0])
    raws = [ckpt.get(n) for n in joined.parts]
    for n, raw in zip(joined.parts, raws):
        if not (np.issubdtype(raw.dtype, np.floating) or raw.dtype == jnp.bfloat16):
            raise CheckpointError(
                f"{ckpt.file_of(n)}: tensor {n} has dtype {raw.dtype}, expected a float type"
            )
    shapes = ", ".join(f"{n} {tuple(r.shape)}" for n, r in zip(joined.parts, raws))
    try:
        arr = np.asarray(joined.combine(*(np.asarray(r) for r in raws)))
    except ValueError as e:
        raise CheckpointError(f"{where}: tensors {shapes}: {e}") from e
    if arr.shape != tuple(shape):
        raise CheckpointError(f"{where}: tensors {shapes} make {arr.shape}, expected {tuple(shape)}")
    return arr


def _key(k):
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def expected_hf_shape(transform, shape) -> tuple:
    if transform is _t:
        return tuple(reversed(shape))
    if transform in (_t_gate, _t_up):  # gate and up rows in one tensor
        return (2 * shape[1], shape[0])
    if transform is _conv:
        return (shape[1], 1, shape[0])
    return tuple(shape)


def abstract_state(model_fn) -> tuple:
    """(graphdef, abstract param state) without materialising random weights."""
    abstract = nnx.eval_shape(model_fn)
    return nnx.split(abstract)
