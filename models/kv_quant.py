"""Quantized KV pages: the storage dtypes ``--kv_cache_dtype`` names, and the one step that
turns computed keys and values into a page's values.

Scale scheme: one scale per tensor, a static number per layer and cache field (K, V, a
latent row, an indexer key), never per page. A page is then its bytes alone: L2 and L3
copy it unchanged, a page written by one request and extended by the next needs no
re-quantization, and the kernels apply the scale outside their loops (a key scale folds
into the softmax scale, a value scale multiplies the output). 8-bit floats keep a relative
error wherever a value lies in their range, so their scale is 1 (what SGLang and vLLM use
without checkpoint scales); int8 has one absolute step, so its scales come from a
calibration pass (``kv_calibrate.py``). Both are part of the L3 namespace (``scheme``).

Per-page-and-head scales were the alternative: a page's scale would have to cover tokens
not yet decoded into it (a decode appends to the last page), so every append past the
scale's range would re-quantize the page, and the kernels would read a second array per
page. Per-token scales avoid that but cost bytes (4 per head per token: 3% at head_dim
128, 25% at the tiny test widths). Static per-channel int8 scales would fold as well (into
the query and the output), but calibrated on a fixed sequence they clip the served text's
channels: on SmolLM2-135M, its float32 pages of 190 tokens of English quantized with scales
from ``kv_calibrate``'s sequence moved prompt logprobs by 0.14 mean (2.0 max) per channel,
0.037 (0.24) per tensor, 0.046 (0.33) as float8_e4m3fn.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# Storage dtypes a page may have besides the model's own, by the name the flag takes.
QUANTIZED = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}
WIDE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# SGLang's and vLLM's names for the same dtypes.
ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "bf16": "bfloat16"}
# Named by a peer and refused as not supported (never "unknown").
NOT_SUPPORTED = {
    "fp4_e2m1": "4-bit KV needs per-block scales, which this cache does not keep",
    "fp8_inc": "Intel Gaudi's fp8 is not a TPU dtype",
    "fp8_ds_mla": "DeepSeek's packed fp8 MLA layout is not implemented; use fp8_e4m3",
}
CHOICES = ("auto", *WIDE, *QUANTIZED, *ALIASES)
INT8_MAX = 127.0


def resolve(name: str, model_dtype) -> jnp.dtype:
    """The pages' dtype for ``--kv_cache_dtype=name`` (``auto``: the model's)."""
    if name in NOT_SUPPORTED:
        raise ValueError(f"kv_cache_dtype={name!r} is not supported: {NOT_SUPPORTED[name]}")
    name = ALIASES.get(name, name)
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name in QUANTIZED:
        return jnp.dtype(QUANTIZED[name])
    if name in WIDE:
        return jnp.dtype(WIDE[name])
    raise ValueError(f"kv_cache_dtype={name!r}: must be one of {', '.join(CHOICES)}")


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype).name in QUANTIZED


def store(x: jax.Array, dtype) -> jax.Array:
    """``x`` (already divided by its scale) as page values of ``dtype``: 8-bit floats
    saturate at their largest finite value (a plain cast overflows to NaN), int8 rounds to
    the nearest step and saturates at +-127 (symmetric); wider dtypes are a cast."""
    dtype = jnp.dtype(dtype)
    if dtype == x.dtype:
        return x
    if dtype.name in ("float8_e4m3fn", "float8_e5m2"):
        top = float(ml_dtypes.finfo(dtype).max)
        return jnp.clip(x.astype(jnp.float32), -top, top).astype(dtype)
    if dtype == jnp.int8:
        return jnp.clip(jnp.round(x.astype(jnp.float32)), -INT8_MAX, INT8_MAX).astype(dtype)
    return x.astype(dtype)


def unscale(x: jax.Array, scale: float = 1.0) -> jax.Array:
    """``x / scale`` in float32, what a layer hands its page write (which ``store``s it);
    ``x`` itself at scale 1, so a unit scale adds no op to the program."""
    if scale == 1.0:
        return x
    return x.astype(jnp.float32) * (1.0 / scale)


def quantize(x: jax.Array, dtype, scale: float = 1.0) -> jax.Array:
    """Computed rows to page values: divided by the tensor's scale, then ``store``."""
    return store(unscale(x, scale), dtype)


def rescale(x: jax.Array, scale: float = 1.0) -> jax.Array:
    """``x * scale`` (an attention output over scaled values, or scores over scaled keys);
    ``x`` itself at scale 1."""
    return x if scale == 1.0 else x * scale


def field_scales(layer_scales, spec: int, fields: int) -> tuple[float, ...]:
    """A layer's scales (``layer_scales``: its ``kv_scales``, per paged spec per field, or
    None) for its ``spec``-th paged spec: one per field, 1.0 where unset."""
    if layer_scales is None:
        return (1.0,) * fields
    return tuple(float(s) for s in layer_scales[spec])


def dequantize(pages: jax.Array, scale: float = 1.0, dtype=jnp.float32) -> jax.Array:
    """Page values back to numbers (the references; the kernels fold the scale instead)."""
    out = pages.astype(jnp.float32)
    if scale != 1.0:
        out = out * scale
    return out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class KVScales:
    """Per cache layer (``ModelConfig.cache_layer_kinds`` order), per paged spec, per field:
    the tensor's scale. ``None`` everywhere 1.0 is meant (8-bit floats, wide dtypes)."""

    per_layer: tuple[tuple[tuple[float, ...], ...], ...]

    def digest(self) -> str:
        """A short id of the numbers (the L3 namespace's scheme)."""
        import hashlib

        flat = np.asarray([s for layer in self.per_layer for spec in layer for s in spec], np.float32)
        return hashlib.sha256(flat.tobytes()).hexdigest()[:12]


def scheme(dtype, scales: KVScales | None) -> str | None:
    """What a stored page's numbers mean beyond its dtype, for the L3 namespace: None for a
    wide dtype (its namespace is that of a store from before quantized pages); per tensor
    with unit scales, or with the calibrated scales' digest."""
    if not is_quantized(dtype):
        return None
    return "tensor-1" if scales is None else f"tensor-{scales.digest()}"
