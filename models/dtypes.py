"""The dtypes a model may be built in, by name (``--dtype``, a checkpoint's config).

Its own module so that both checkpoint readers (``loader.py``, ``orbax_io.py``) use it
without importing each other."""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype, hf: dict | None = None):
    if dtype in (None, "auto"):
        name = (hf or {}).get("dtype") or (hf or {}).get("torch_dtype") or "float32"
        return DTYPES.get(name, jnp.float32)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} not in {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)
