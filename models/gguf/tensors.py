"""GGUF tensors under the Hugging Face names ``load_params`` asks for, dequantized on read.

The layout facts of llama.cpp's files are undone here, so a tensor read equals the one in
the Hugging Face checkpoint it was converted from:

- shapes are stored fastest-dimension first (``ne``); numpy's order is the reverse;
- for the ``llama`` and ``granitehybrid`` architectures the converter reorders the rows of
  ``attn_q``/``attn_k`` in each head from halves (rotate-half RoPE) to interleaved pairs
  (llama.cpp's rotary kernel);
- for Gemma the converter stores RMSNorm scales as ``1 + w``; transformers' Gemma keeps ``w``;
- for ``granitehybrid`` (Bamba) the Mamba2 tensors are reshaped and ``A_log`` stored as
  ``-exp(A_log)``: see ``granitehybrid.py``.
"""

from __future__ import annotations

import os
import re

import numpy as np

from hicache_jax.models.gguf import granitehybrid
from hicache_jax.models.gguf.reader import architecture, hf_config, open_gguf
from hicache_jax.models.hf.safetensors_io import CheckpointError

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
GLOBAL = {"llama": _GLOBAL, "gemma3": _GLOBAL, granitehybrid.ARCH: granitehybrid.GLOBAL}
LAYER = {
    "llama": {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
}
LAYER["gemma3"] = {
    **LAYER["llama"],
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
LAYER[granitehybrid.ARCH] = granitehybrid.LAYER
BARE = {granitehybrid.ARCH: granitehybrid.BARE}  # no .weight/.bias suffix in transformers
PERMUTED_QK = ("llama", granitehybrid.ARCH)  # the converter's undo_permute

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _quant_types():
    from gguf import GGMLQuantizationType as Q

    return {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
    }


def gguf_name(arch: str, hf_name: str) -> str | None:
    """llama.cpp's name for a Hugging Face tensor name (None: no such tensor in GGUF)."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in GLOBAL[arch]:
        return f"{GLOBAL[arch][stem]}.{kind}"
    m = _LAYER_NAME.fullmatch(hf_name)
    if m is None:
        return None
    i, rest = m.groups()
    if rest in BARE.get(arch, {}):
        return f"blk.{i}.{BARE[arch][rest]}"
    stem, _, kind = rest.rpartition(".")
    if kind not in ("weight", "bias") or stem not in LAYER[arch]:
        return None
    return f"blk.{i}.{LAYER[arch][stem]}.{kind}"


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved pairs back to two halves."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise CheckpointError(f"{rows} rows do not split into {heads} heads of rotary pairs")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(t, path: str) -> np.ndarray:
    """One GGUF tensor as float32 in numpy's (Hugging Face's) shape."""
    from gguf import quants

    if t.tensor_type not in _quant_types():
        supported = sorted(q.name for q in _quant_types())
        raise CheckpointError(
            f"{path}: tensor {t.name} has quantization {t.tensor_type.name}, not supported "
            f"(supported: {', '.join(supported)})"
        )
    shape = tuple(int(n) for n in reversed(t.shape))
    try:
        out = quants.dequantize(t.data, t.tensor_type)
        return np.asarray(out, dtype=np.float32).reshape(shape)
    except (ValueError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{path}: tensor {t.name} ({t.tensor_type.name}) is corrupt ({e})") from e


class GGUFCheckpoint:
    """A GGUF file with the read interface of ``safetensors_io.Checkpoint``."""

    def __init__(self, path: str):
        self.path = path
        self.model_dir = os.path.dirname(path)
        self.reader = open_gguf(path)
        self.arch = architecture(self.reader, path)
        self.hf = hf_config(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.files = {os.path.basename(path): self}
        self.where = {}
        for name in self._hf_names():
            if gguf_name(self.arch, name) in self.tensors:
                self.where[name] = os.path.basename(path)

    def _hf_names(self):
        yield from (f"{stem}.weight" for stem in GLOBAL[self.arch])
        for i in range(self.hf["num_hidden_layers"]):
            for stem in LAYER[self.arch]:
                yield from (f"model.layers.{i}.{stem}.{kind}" for kind in ("weight", "bias"))
            yield from (f"model.layers.{i}.{name}" for name in BARE.get(self.arch, {}))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def file_of(self, name: str) -> str:
        return self.path

    def get(self, name: str) -> np.ndarray:
        g = gguf_name(self.arch, name)
        if g is None or g not in self.tensors:
            raise CheckpointError(
                f"{self.path}: tensor {g or name} (for {name}) is missing from the GGUF file"
            )
        w = dequantize(self.tensors[g], self.path)
        try:
            if self.arch in PERMUTED_QK and g.endswith((".attn_q.weight", ".attn_k.weight")):
                heads = self.hf["num_attention_heads" if ".attn_q." in g else "num_key_value_heads"]
                w = unpermute_rotary(w, heads)
            if self.arch == granitehybrid.ARCH:
                w = granitehybrid.undo(g, w)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: tensor {g}: {e}") from e
        if self.arch == "gemma3" and g.endswith("norm.weight"):
            w = w - 1.0
        return w
