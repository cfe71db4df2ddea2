"""MXFP4, the format gpt-oss checkpoints store their expert weights in.

A weight ``[..., rows, cols]`` is kept as ``<name>_blocks`` ``[..., rows, cols / 32, 16]``
uint8 and ``<name>_scales`` ``[..., rows, cols / 32]`` uint8. Each group of 32 values along
``cols`` shares one scale, a power of two stored as its exponent plus 127 (E8M0). Each byte
holds two FP4 (E2M1) values, the element at the even position in its low four bits and the
odd one in its high four; a nibble is a sign bit and an index into the eight magnitudes
below. Every value is a small float times a power of two, so the result is exact in
bfloat16 and float32.

gpt-oss's stored rows are the output features: ``gate_up_proj`` is ``[E, 2I, H]`` as blocks
(``[E, 2I, H / 32, 16]``) and dequantizes to the ``[E, H, 2I]`` its bf16 checkpoints hold,
after a transpose of the last two axes; ``down_proj`` likewise to ``[E, I, H]``.
"""

from __future__ import annotations

import numpy as np

MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4 = np.concatenate([MAGNITUDES, -MAGNITUDES])  # the 16 codes: bit 3 is the sign
GROUP = 32  # values per scale
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` float32.
    Raises ValueError naming the shapes when they do not fit together."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            f"expected blocks [..., G, {GROUP // 2}] and scales [..., G]"
        )
    b = np.asarray(blocks)
    values = np.empty(b.shape[:-1] + (GROUP,), np.float32)
    values[..., 0::2] = FP4[b & 0x0F]
    values[..., 1::2] = FP4[b >> 4]
    values = np.ldexp(values, np.asarray(scales, np.int32)[..., None] - SCALE_BIAS)
    return values.reshape(values.shape[:-2] + (-1,))


def dequantize_weight(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One stored weight (``[..., rows, G, 16]`` and ``[..., rows, G]``) -> ``[..., cols, rows]``:
    dequantized, then the last two axes swapped (input features first, as our kernels are)."""
    return np.swapaxes(dequantize(blocks, scales), -1, -2)
