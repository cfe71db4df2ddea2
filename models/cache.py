"""The per-layer cache pytrees a model step reads and returns, and the one declaration of
what each layer kind caches.

``paged_specs(cfg, layer_kind)`` is where a layer kind declares its paged cache: per cache
kind it uses, the entry (a NamedTuple whose fields are ``[pages, page_size, *per_token]``
arrays), the per-token shape, whether its first axis is KV heads (split over tensor
parallelism) and the name of its L2/L3 row. Allocation, sharding, layer-by-layer page
loads, the L2 row layout and transfers, page bytes and the planner read it; none of them
knows a layer's shapes by itself. Recurrent kinds declare their state slots the same way
through ``ModelConfig.state_shapes`` (``state_shapes`` below).

A layer that pages one cache kind has that kind's entry as its cache entry; a layer that
pages several has a tuple of them, in declaration order (``parts`` / ``join``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hicache_jax.kinds import RECURRENT, CacheKind, LayerKind
from hicache_jax.models.config import ModelConfig


class KVPages(NamedTuple):
    k: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]


class RecurrentState(NamedTuple):
    """A recurrent layer's state slots (every recurrent kind: ``state_shapes``)."""

    conv: jax.Array  # [num_slots, conv_kernel - 1, conv_dim]: last conv inputs
    ssm: jax.Array  # [num_slots, ...]: the recurrence's state, float32


MambaState = RecurrentState  # the name Mamba2 code and older callers use


class LatentPages(NamedTuple):
    """MLA's cache: per token the normed latent, then the rope-applied key every head shares."""

    c: jax.Array  # [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]


class IndexPages(NamedTuple):
    """A sparse-attention indexer's keys."""

    k: jax.Array  # [num_pages, page_size, index_head_dim]


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """One cache kind's pages of one layer."""

    kind: CacheKind
    entry: type  # NamedTuple of [num_pages, page_size, *per_token] arrays
    per_token: tuple[int, ...]  # one token's entry in each field (the whole model's, tp_size 1)
    heads: bool  # per_token[0] is KV heads: split over the mesh, copied when fewer than tp_size
    row: str  # the L2 row's name: [layers, fields, page_size, *per_token] (``host_pool.py``)

    def shape(self, num_pages: int, page_size: int, heads: int | None = None) -> tuple[int, ...]:
        """One field's array; ``heads``: KV heads on the device, when they differ."""
        per_token = self.per_token
        if self.heads and heads is not None:
            per_token = (heads, *per_token[1:])
        return (num_pages, page_size, *per_token)

    def token_values(self) -> int:
        """Values one token stores in this layer (every field)."""
        n = len(self.entry._fields)
        for d in self.per_token:
            n *= d
        return n


def paged_specs(cfg: ModelConfig, kind: str) -> tuple[PagedSpec, ...]:
    """What a layer of ``kind`` pages, one spec per cache kind (none for recurrent kinds)."""
    kind = LayerKind(kind)
    if kind in (LayerKind.ATTENTION, LayerKind.SLIDING):
        group = CacheKind.FULL if kind == LayerKind.ATTENTION else CacheKind.SWA
        return (PagedSpec(group, KVPages, (cfg.num_kv_heads, cfg.head_dim), heads=True, row="kv"),)
    if kind in (LayerKind.MLA, LayerKind.DSA, LayerKind.DSA_SHARED):
        m = cfg.mla
        latent = PagedSpec(CacheKind.LATENT, LatentPages, (m.latent_dim,), heads=False, row="latent")
        if kind != LayerKind.DSA:
            return (latent,)
        return latent, PagedSpec(CacheKind.INDEX, IndexPages, (m.index_head_dim,), heads=False, row="index")
    if kind in RECURRENT:
        return ()
    raise ValueError(f"layer kind {kind!r} declares no cache")


def parts(entry, specs: tuple[PagedSpec, ...]) -> tuple:
    """A layer's cache entry as one entry per spec."""
    return (entry,) if len(specs) == 1 else tuple(entry)


def join(entries, specs: tuple[PagedSpec, ...]):
    """The inverse of ``parts``."""
    return entries[0] if len(specs) == 1 else tuple(entries)


def layer_specs(cfg: ModelConfig) -> tuple[tuple[PagedSpec, ...], ...]:
    """Every layer's paged specs, in layer order."""
    return tuple(paged_specs(cfg, k) for k in cfg.layer_kinds)


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
    """One entry per layer: its paged entries (``paged_specs``), or RecurrentState.

    ``num_pages`` is per cache kind or one number for all. ``kv_heads`` (default the
    model's) is more under tensor parallelism with replicated KV heads (``models/sharding.py``).
    """
    entries = []
    for kind in cfg.layer_kinds:
        if kind in RECURRENT:
            spec = state_shapes(cfg, kind, dtype)
            entries.append(
                RecurrentState(*(jnp.full((num_state_slots, *shape), fill, dt) for shape, dt in spec))
            )
            continue
        specs = paged_specs(cfg, kind)
        made = []
        for s in specs:
            n = num_pages if isinstance(num_pages, int) else num_pages[s.kind]
            shape = s.shape(n, page_size, kv_heads)
            made.append(s.entry(*(jnp.full(shape, fill, dtype) for _ in s.entry._fields)))
        entries.append(join(made, specs))
    return tuple(entries)
