"""Bytes of one L2/L3 page of each kind a model stores, and the L3 bandwidth at a token rate.

Pages are stored whole (the same at every tp_size): per token, full-attention layers store K
and V of every KV head; sliding-window layers the same, but a prefix hit reads only the
window behind its end; recurrent layers store at most one state snapshot per page.
"""

from __future__ import annotations

import collections

from hicache_jax.kinds import L3_SUFFIX, PAGED, CacheKind, cache_kind

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def page_bytes(cfg, dtype_bytes: int, page_size: int) -> dict[str, int]:
    """Bytes of one page of each kind the model stores (``storage_tier.SUFFIX`` kinds)."""
    layers = collections.Counter(cache_kind(k) for k in cfg.layer_kinds)  # layers per cache kind
    kv = 2 * page_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    out = {L3_SUFFIX[kind]: layers[kind] * kv for kind in PAGED if layers[kind]}
    if layers[CacheKind.STATE]:  # one snapshot holds every recurrent layer's state
        out[L3_SUFFIX[CacheKind.STATE]] = cfg.state_bytes(dtype_bytes)
    return out


def read_bytes_per_token(cfg, dtype_bytes: int, page_size: int) -> float:
    """Upper bound of the L3 bytes read per prompt token a hit serves (KV pages; sliding
    layers read only their window, recurrent layers one snapshot per hit, both less)."""
    pages = page_bytes(cfg, dtype_bytes, page_size)
    return sum(pages.get(L3_SUFFIX[kind], 0) for kind in PAGED) / page_size
