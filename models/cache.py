"""The per-layer cache pytrees a model step reads and returns."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hicache_jax.models.batch import page_group
from hicache_jax.models.config import ModelConfig


class KVPages(NamedTuple):
    k: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]


class MambaState(NamedTuple):
    conv: jax.Array  # [num_slots, conv_kernel - 1, conv_dim]: last conv inputs
    ssm: jax.Array  # [num_slots, num_heads, head_dim, state_size], float32


def allocate_cache(
    cfg: ModelConfig,
    *,
    num_pages: dict[str, int] | int,
    page_size: int,
    num_state_slots: int = 0,
    dtype=jnp.float32,
    fill: float = 0.0,
    kv_heads: int | None = None,
) -> tuple:
    """One entry per layer: KVPages for attention layers, MambaState for Mamba layers.

    ``num_pages`` is per page group (``"full"``, ``"swa"``) or one number for both.
    ``kv_heads`` (default the model's) is more under tensor parallelism with replicated
    KV heads (``models/sharding.py``).
    """
    entries = []
    for kind in cfg.layer_kinds:
        if kind == "mamba":
            m = cfg.mamba
            entries.append(
                MambaState(
                    conv=jnp.full((num_state_slots, m.conv_kernel - 1, m.conv_dim), fill, dtype),
                    ssm=jnp.full((num_state_slots, m.num_heads, m.head_dim, m.state_size), fill, jnp.float32),
                )
            )
        else:
            n = num_pages if isinstance(num_pages, int) else num_pages[page_group(kind)]
            shape = (n, page_size, kv_heads or cfg.num_kv_heads, cfg.head_dim)
            entries.append(KVPages(jnp.full(shape, fill, dtype), jnp.full(shape, fill, dtype)))
    return tuple(entries)
