"""The per-layer cache pytrees a model step reads and returns."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hicache_jax.kinds import RECURRENT
from hicache_jax.models.batch import page_group
from hicache_jax.models.config import ModelConfig


class KVPages(NamedTuple):
    k: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]


class RecurrentState(NamedTuple):
    """A recurrent layer's state slots (every recurrent kind: ``state_shapes``)."""

    conv: jax.Array  # [num_slots, conv_kernel - 1, conv_dim]: last conv inputs
    ssm: jax.Array  # [num_slots, ...]: the recurrence's state, float32


MambaState = RecurrentState  # the name Mamba2 code and older callers use


def state_shapes(cfg: ModelConfig, kind: str, dtype) -> RecurrentState:
    """One slot's state for a recurrent layer kind, as a ``RecurrentState`` of ``(shape,
    dtype)`` (``ModelConfig.state_shapes`` declares them; conv inputs in the cache dtype)."""
    return RecurrentState(*((shape, jnp.dtype(d) if d else dtype) for shape, d in cfg.state_shapes(kind)))


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
    """One entry per layer: KVPages for attention layers, RecurrentState for recurrent ones.

    ``num_pages`` is per page group (``"full"``, ``"swa"``) or one number for both.
    ``kv_heads`` (default the model's) is more under tensor parallelism with replicated
    KV heads (``models/sharding.py``).
    """
    entries = []
    for kind in cfg.layer_kinds:
        if kind in RECURRENT:
            spec = state_shapes(cfg, kind, dtype)
            entries.append(
                RecurrentState(*(jnp.full((num_state_slots, *shape), fill, dt) for shape, dt in spec))
            )
        else:
            n = num_pages if isinstance(num_pages, int) else num_pages[page_group(kind)]
            shape = (n, page_size, kv_heads or cfg.num_kv_heads, cfg.head_dim)
            entries.append(KVPages(jnp.full(shape, fill, dtype), jnp.full(shape, fill, dtype)))
    return tuple(entries)
