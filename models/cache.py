"""The per-layer cache pytrees a model step reads and returns, and the one declaration of
what each layer kind caches.

``paged_specs(cfg, layer_kind)`` is where a layer kind declares its paged cache: per cache
kind it uses, the entry (a NamedTuple whose fields are ``[pages, rows, *per_row]`` arrays),
the rows a page holds (one per token, one per ``rate`` tokens for a compressed kind, or one
per page for a state taken at the page's end), the per-row shape, its dtype when not the
cache's, whether its first axis is KV heads (split over tensor parallelism) and the name
of its L2/L3 row. Allocation, sharding, layer-by-layer page
loads, the L2 row layout and transfers, page bytes and the planner read it; none of them
knows a layer's shapes by itself. Recurrent kinds declare their state slots the same way
through ``ModelConfig.state_shapes`` (``state_shapes`` below).

A layer that pages one cache kind has that kind's entry as its cache entry; a layer that
pages several has a tuple of them, in declaration order (``parts`` / ``join``).
"""

from __future__ import annotations

import dataclasses
import math
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

    k: jax.Array  # [num_pages, page_size (or compressed entries), index_head_dim]


class SharedKVPages(NamedTuple):
    """One head whose rows are keys and values alike (DeepSeek V4's window and its
    compressed entries)."""

    kv: jax.Array  # [num_pages, page_size (or compressed entries), head_dim]


class CompressorState(NamedTuple):
    """A compressor's unfinished windows after a page's last token: per channel the
    log-sum-exp of the gates seen and the softmax-weighted mean of their values (float32),
    one row per page (``layers/dsv4.py``)."""

    lse: jax.Array  # [num_pages, 1, windows, channels]
    mean: jax.Array  # [num_pages, 1, windows, channels]


PAGE_ROW = 0  # ``PagedSpec.rate`` of a kind that keeps one row per page


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """One cache kind's pages of one layer."""

    kind: CacheKind
    entry: type  # NamedTuple of [num_pages, rows, *per_row] arrays
    per_row: tuple[int, ...]  # one row of each field (the whole model's, tp_size 1)
    heads: bool  # per_row[0] is KV heads: split over the mesh, copied when fewer than tp_size
    row: str  # the L2 row's name: [layers, fields, rows, *per_row] (``host_pool.py``)
    rate: int = 1  # tokens per row (PAGE_ROW: one row per page)
    dtype: str | None = None  # None: the cache's dtype

    def rows(self, page_size: int) -> int:
        """Rows a page of ``page_size`` tokens holds."""
        if self.rate == PAGE_ROW:
            return 1
        if page_size % self.rate:
            raise ValueError(
                f"page_size {page_size} is not a multiple of {self.rate}, the tokens per entry "
                f"of the {self.kind} cache (a page holds whole entries: set --page_size to a multiple)"
            )
        return page_size // self.rate

    def shape(self, num_pages: int, page_size: int, heads: int | None = None) -> tuple[int, ...]:
        """One field's array; ``heads``: KV heads on the device, when they differ."""
        per_row = self.per_row
        if self.heads and heads is not None:
            per_row = (heads, *per_row[1:])
        return (num_pages, self.rows(page_size), *per_row)

    def page_values(self, page_size: int) -> int:
        """Values one page stores in this layer (every field)."""
        return len(self.entry._fields) * self.rows(page_size) * math.prod(self.per_row)

    def value_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one value: the cache's, or this kind's own dtype's."""
        return dtype_bytes if self.dtype is None else jnp.dtype(self.dtype).itemsize


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
    if kind in (LayerKind.SWA_MQA, LayerKind.CSA, LayerKind.HCA):
        return _dsv4_specs(cfg, kind)
    if kind in RECURRENT:
        return ()
    raise ValueError(f"layer kind {kind!r} declares no cache")


def _dsv4_specs(cfg: ModelConfig, kind: LayerKind) -> tuple[PagedSpec, ...]:
    """A DeepSeek V4 layer: its window's rows; a compressed layer also its entries (and the
    indexer's keys), and its compressor's state at each page's end."""
    v, D = cfg.dsv4, cfg.head_dim
    window = PagedSpec(CacheKind.SWA, SharedKVPages, (D,), heads=False, row="kv")
    if kind == LayerKind.SWA_MQA:
        return (window,)
    rate = v.rate(kind)
    if kind == LayerKind.HCA:
        entries = PagedSpec(CacheKind.HCA, SharedKVPages, (D,), heads=False, row="hca", rate=rate)
        state = PagedSpec(
            CacheKind.HCA_STATE,
            CompressorState,
            (1, D),
            heads=False,
            row="state",
            rate=PAGE_ROW,
            dtype="float32",
        )
        return window, entries, state
    entries = PagedSpec(CacheKind.CSA, SharedKVPages, (D,), heads=False, row="csa", rate=rate)
    keys = PagedSpec(CacheKind.INDEX, IndexPages, (v.index_head_dim,), heads=False, row="index", rate=rate)
    # Two running windows (overlapping by one), the entries' channels then the indexer's.
    state = PagedSpec(
        CacheKind.CSA_STATE,
        CompressorState,
        (2, D + v.index_head_dim),
        heads=False,
        row="state",
        rate=PAGE_ROW,
        dtype="float32",
    )
    return window, entries, keys, state


def parts(entry, specs: tuple[PagedSpec, ...]) -> tuple:
    """A layer's cache entry as one entry per spec."""
    return (entry,) if len(specs) == 1 else tuple(entry)


def join(entries, specs: tuple[PagedSpec, ...]):
    """The inverse of ``parts``."""
    return entries[0] if len(specs) == 1 else tuple(entries)


def layer_specs(cfg: ModelConfig) -> tuple[tuple[PagedSpec, ...], ...]:
    """Every cache entry's paged specs, in entry order (``ModelConfig.cache_layer_kinds``:
    the main layers, then a drafting block's). Every layer that pages a cache kind pages it
    alike (one L2/L3 row stacks them)."""
    out = tuple(paged_specs(cfg, k) for k in cfg.cache_layer_kinds)
    first: dict = {}
    for specs in out:
        for s in specs:
            if first.setdefault(s.kind, s) != s:
                raise ValueError(f"layers page the {s.kind} cache differently: {first[s.kind]} and {s}")
    return out


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
    kv_dtype=None,
    fill: float = 0.0,
    kv_heads: int | None = None,
) -> tuple:
    """One entry per cache layer (``ModelConfig.cache_layer_kinds``: the main layers, then
    a drafting block's): its paged entries (``paged_specs``), or RecurrentState.

    ``num_pages`` is per cache kind or one number for all. ``kv_heads`` (default the
    model's) is more under tensor parallelism with replicated KV heads (``models/sharding.py``).
    ``kv_dtype`` (default ``dtype``) is the pages' (``--kv_cache_dtype``, ``kv_quant.py``);
    recurrent state and a kind with its own dtype keep theirs.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    entries = []
    for kind in cfg.cache_layer_kinds:
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
            dt = kv_dtype if s.dtype is None else jnp.dtype(s.dtype)
            made.append(s.entry(*(jnp.full(shape, fill, dt) for _ in s.entry._fields)))
        entries.append(join(made, specs))
    return tuple(entries)
