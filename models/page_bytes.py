"""Bytes of one L2/L3 page of each kind a model stores, and the L3 bandwidth at a token rate.

Pages are stored whole (the same at every tp_size), as the layers declare them
(``models/cache.py``, ``paged_specs``): per page, every cache layer that pages a cache kind
stores its fields' rows (K and V of every KV head of every token for attention, one row per
``rate`` tokens of a compressed kind, one per page of a compressor's state). A prefix hit reads every page of
an every-page kind, only the window behind its end of a window kind, and one state snapshot
for recurrent layers (at most one per page).
"""

from __future__ import annotations

import collections

from hicache_jax.kinds import L3_SUFFIX, RECURRENT, Retention, layer_cache, retention
from hicache_jax.models.cache import layer_specs

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPE_BYTES = {**DTYPE_BYTES, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


def page_bytes(cfg, dtype_bytes: int, page_size: int, kv_bytes: int | None = None) -> dict[str, int]:
    """Bytes of one page of each kind the model stores, by L3 suffix. ``dtype_bytes``: the
    model's values (recurrent state's conv inputs); ``kv_bytes``: the paged caches' values
    without a dtype of their own (``--kv_cache_dtype``; default ``dtype_bytes``)."""
    kv_bytes = dtype_bytes if kv_bytes is None else kv_bytes
    out: dict[str, int] = collections.Counter()
    for specs in layer_specs(cfg):
        for s in specs:
            out[L3_SUFFIX[s.kind]] += s.page_values(page_size) * s.value_bytes(kv_bytes)
    out = dict(out)
    recurrent = [k for k in cfg.cache_layer_kinds if k in RECURRENT]
    if recurrent:  # one snapshot holds every recurrent layer's state
        out[L3_SUFFIX[layer_cache(recurrent[0])[0]]] = cfg.state_bytes(dtype_bytes)
    return out


def read_bytes_per_token(cfg, dtype_bytes: int, page_size: int, kv_bytes: int | None = None) -> float:
    """Upper bound of the L3 bytes read per prompt token a hit serves (every page kind's
    pages; window kinds read only their window, recurrent layers one snapshot per hit, both
    less). ``kv_bytes``: as ``page_bytes``."""
    pages = page_bytes(cfg, dtype_bytes, page_size, kv_bytes)
    paged = [k for k in L3_SUFFIX if retention(k) is not Retention.SNAPSHOT]
    return sum(pages.get(L3_SUFFIX[kind], 0) for kind in paged) / page_size
