"""FP8 with 128x128 block scales, the format of DeepSeek V3's published weights and of the
FP8 releases of DeepSeek V3.2, GLM-5 and Qwen3 (``quantization_config``: ``{"quant_method":
"fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}``).

A quantized Linear keeps ``N.weight`` ``[out, in]`` as float8_e4m3fn and, beside it,
``N.weight_scale_inv`` ``[ceil(out / 128), ceil(in / 128)]`` float32. The real weight is

    weight[i, j] * weight_scale_inv[i // 128, j // 128]

so each 128x128 tile shares one scale; the last row and column of tiles may be partial
(DeepSeek V3's ``kv_a_proj_with_mqa`` is ``[576, 7168]``: 4.5 tiles tall, its scales
``[5, 56]``). Only the Linears the quantizer converted have a ``weight_scale_inv``;
embeddings, norms, ``lm_head`` and MoE router gates stay bf16 or float32, so the companion
tensor, not a name list (``modules_to_not_convert``), says what to dequantize.

E4M3 ("fn": finite, no infinities): a sign bit, four exponent bits with bias 7 and three
mantissa bits; exponent 0 is subnormal (``m / 8 * 2**-6``); ``0x7f`` and ``0xff`` are NaN,
so the largest value is 448. The product is rounded once to float32 (as DeepSeek's own
``weight_dequant`` and transformers' dequantization compute it), then to the serving dtype.

DeepSeek V4's published weights (``scale_fmt: "ue8m0"``, ``expert_dtype: "fp4"``) store the
scales as E8M0 bytes (``float8_e8m0fnu``: a power of two, ``2 ** (byte - 127)``; 0xff is NaN)
and the routed experts' weights as FP4: ``N.weight`` ``[out, in / 2]`` int8, two E2M1 values
a byte (the even column in the low four bits, as MXFP4, ``mxfp4.py``), with
``N.weight_scale_inv`` ``[out, in / 32]``: each run of 32 values along a row shares a scale.
Both read dequantized here; the weight's dtype (E4M3 or int8) says which rule applies.
The published V4 files name a weight's scales ``N.scale`` (DeepSeek's ``Linear.scale``),
not ``N.weight_scale_inv``; either name is read.

Not supported, and refused by ``check_config`` or on read: per-tensor or per-channel
scales (``weight_block_size`` null, ``weight_scale`` tensors), other block sizes and E5M2.
Activation scales (``activation_scheme``) do not matter here: weights are dequantized and
activations stay in the serving dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hicache_jax.models.hf import mxfp4
from hicache_jax.models.hf.safetensors_io import CheckpointError

BLOCK = (128, 128)  # (rows, cols) of a weight that share one scale
SCALE = "_scale_inv"  # N.weight's scales are N.weight_scale_inv
V4_SCALE = "scale"  # or, in DeepSeek V4's published files, N.scale
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FP4_GROUP = (1, mxfp4.GROUP)  # an FP4 weight: 32 values of a row share a scale


def scales_f32(scale_inv: np.ndarray) -> np.ndarray:
    """Stored scales as float32: float32 as they are, E8M0 bytes as their powers of two."""
    if scale_inv.dtype == E8M0:
        return np.asarray(scale_inv).astype(np.float32)
    return scale_inv


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """``[..., n]`` int8 (or uint8), two E2M1 codes a byte, low nibble first -> ``[..., 2n]``
    float32."""
    b = np.asarray(packed).view(np.uint8)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.float32)
    out[..., 0::2] = mxfp4.FP4[b & 0x0F]
    out[..., 1::2] = mxfp4.FP4[b >> 4]
    return out


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """``weight [..., out, in]`` float8_e4m3fn and ``scale_inv [..., ceil(out / b0),
    ceil(in / b1)]`` float32 -> ``[..., out, in]`` float32. Raises ValueError naming the
    shapes (or dtypes) when they do not fit together."""
    if weight.dtype not in (E4M3, np.int8) or scale_inv.dtype not in (np.float32, E8M0):
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} and weight_scale_inv {tuple(scale_inv.shape)} "
            f"{scale_inv.dtype}: expected float8_e4m3fn (or FP4 packed in int8) and float32 (or E8M0)"
        )
    scale_inv = scales_f32(scale_inv)
    if weight.dtype == np.int8:  # FP4: unpacked, then one scale per 32 values of a row
        weight, block = unpack_fp4(weight), FP4_GROUP
    b0, b1 = block
    if b0 < 1 or b1 < 1:
        raise ValueError(f"block {tuple(block)}: expected two positive sizes")
    if weight.ndim < 2:
        raise ValueError(f"weight {tuple(weight.shape)}: expected [..., out, in]")
    *lead, rows, cols = weight.shape
    R, C = -(-rows // b0), -(-cols // b1)  # tiles, the last ones maybe partial
    if scale_inv.shape != (*lead, R, C):
        raise ValueError(
            f"weight {tuple(weight.shape)} and weight_scale_inv {tuple(scale_inv.shape)} do not match: "
            f"{b0}x{b1} blocks need scales {(*lead, R, C)}"
        )
    out = np.zeros((*lead, R * b0, C * b1), np.float32)  # padded to whole tiles
    out[..., :rows, :cols] = weight
    tiles = out.reshape(*lead, R, b0, C, b1)  # a view: scaling it scales out
    tiles *= scale_inv[..., :, None, :, None]
    return out[..., :rows, :cols]


def check_config(quant: dict, where: str) -> None:
    """Refuse an ``"fp8"`` ``quantization_config`` this module cannot dequantize."""
    fmt, block = quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: FP8 fmt {fmt!r} is not supported (e4m3)")
    if block is None:
        raise CheckpointError(
            f"{where}: FP8 with per-tensor scales (weight_block_size null) is not supported "
            f"(only {BLOCK[0]}x{BLOCK[1]} block scales)"
        )
    if list(block) != list(BLOCK):
        raise CheckpointError(
            f"{where}: FP8 weight_block_size {list(block)} is not supported ({list(BLOCK)})"
        )
    if quant.get("expert_dtype", "fp8") not in ("fp8", "fp4"):
        raise CheckpointError(
            f"{where}: FP8 expert_dtype {quant['expert_dtype']!r} is not supported (fp8, fp4)"
        )
    if quant.get("scale_fmt") not in (None, "float", "ue8m0"):
        raise CheckpointError(
            f"{where}: FP8 scale_fmt {quant['scale_fmt']!r} is not supported (float, ue8m0)"
        )


def scale_names(weight: str) -> tuple[str, str]:
    """Where ``N.weight``'s block scales may be: ``N.weight_scale_inv``, or ``N.scale``."""
    return weight + SCALE, weight.removesuffix("weight") + V4_SCALE


class Dequantized:
    """A checkpoint whose block-scaled FP8 weights read dequantized: ``get("N.weight")``
    with ``N.weight_scale_inv`` beside it gives float32 ``[out, in]``; every other tensor
    (the scales themselves too) reads as stored."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def scale_of(self, name: str) -> str | None:
        """The name of ``N.weight``'s scales in this checkpoint, or None."""
        if not name.endswith(".weight"):
            return None
        for scale in scale_names(name):
            if scale in self.ckpt:
                return scale
        return None

    def get(self, name: str) -> np.ndarray:
        raw = self.ckpt.get(name)
        scale = self.scale_of(name)
        if scale is not None:
            try:
                return dequantize(raw, self.ckpt.get(scale))
            except ValueError as e:
                raise CheckpointError(f"{self.ckpt.file_of(name)}: tensor {name}: {e}") from e
        if raw.dtype == E4M3:
            raise CheckpointError(
                f"{self.ckpt.file_of(name)}: tensor {name} is float8_e4m3fn; only a Linear's weight "
                f"N.weight with N.weight{SCALE} or N.{V4_SCALE} ({BLOCK[0]}x{BLOCK[1]} block scales) "
                "beside it is dequantized"
            )
        return raw

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def __getattr__(self, attr):
        return getattr(self.ckpt, attr)
