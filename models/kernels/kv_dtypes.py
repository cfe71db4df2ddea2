"""Which KV page dtypes the Pallas TPU kernels read, on which chips: the rule
``--kv_cache_dtype`` is checked against at start-up (``check``).

Found by compiling (``tests/tpu/test_kv_quant_kernels.py``; libtpu, no chip): the paged
attention, row attention, indexer and KV-write kernels compile with float8_e4m3fn,
float8_e5m2 and int8 pages on v4, v5e, v5p, v6e and TPU7x. The kernels copy 8-bit pages as
they are and widen them in VMEM, so no chip's MXU needs an 8-bit input. float16 pages are
not read by the kernels (they take float32, bfloat16 and the 8-bit dtypes); chips before
v4 are not supported by the kernels at all.
"""

from __future__ import annotations

import jax.numpy as jnp

from hicache_jax.models import kv_quant

WIDE = ("float32", "bfloat16")
QUANTIZED = tuple(kv_quant.QUANTIZED)  # every 8-bit page dtype the flag takes
# The page dtypes each chip's kernels compile with (checked per chip by the tpu tests).
CHIP_DTYPES = {chip: WIDE + QUANTIZED for chip in ("v4", "v5e", "v5p", "v6e", "7x")}
FLAG = "--kv_cache_dtype"


def chip_name(device_kind: str) -> str | None:
    """``"TPU v6 lite"`` -> ``"v6e"`` (the names of ``CHIP_DTYPES``); None when unknown."""
    kind = device_kind.lower()
    markers = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"), ("v5p", "v5p"))
    for marker, name in markers:
        if marker in kind:
            return name
    if "7x" in kind or "v7" in kind:
        return "7x"
    if kind.rstrip().endswith("v4") or "v4" in kind.split():
        return "v4"
    return None


def unsupported_reason(dtype, chip: str | None = None) -> str | None:
    """Why the Pallas kernels cannot read pages of ``dtype`` (on ``chip``, when known); None
    when they can. A chip missing from ``CHIP_DTYPES`` is refused only for the dtypes no
    chip takes (its compile is not checked here: the kernels say)."""
    name = jnp.dtype(dtype).name
    every = WIDE + QUANTIZED
    if name not in every:
        return f"{name} pages are not read by the Pallas kernels (they read {', '.join(every)})"
    if chip in CHIP_DTYPES and name not in CHIP_DTYPES[chip]:
        return f"{name} pages do not compile on TPU {chip} (it takes {', '.join(CHIP_DTYPES[chip])})"
    return None


def check(dtype, chip: str | None = None) -> None:
    """Raise ``ValueError`` naming ``--kv_cache_dtype`` when the kernels cannot read pages
    of ``dtype`` on ``chip``."""
    reason = unsupported_reason(dtype, chip)
    if reason:
        raise ValueError(f"{FLAG}={jnp.dtype(dtype).name}: {reason}; choose another {FLAG}")


def current_chip() -> str | None:
    """The chip of JAX's default device (None off TPU)."""
    import jax

    device = jax.devices()[0]
    return chip_name(device.device_kind) if device.platform == "tpu" else None
