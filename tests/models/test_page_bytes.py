"""``page_bytes`` (what the planner and the L3 bandwidth estimate count) equals the bytes of
the L2 rows the engine actually allocates, per cache kind, for every family."""

import jax
import numpy as np
import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.kinds import L3_SUFFIX, PAGED
from hicache_jax.models.page_bytes import page_bytes, read_bytes_per_token


@pytest.mark.parametrize(
    "preset, page_size",
    # + latent + indexer; DeepSeek V4's window, entries, indexer keys and float32 states per
    # page (its pages hold whole HCA entries of 16 tokens)
    [("tiny-swa", 8), ("tiny-mamba", 8), ("tiny-qwen3.5", 8), ("tiny-dsa", 8), ("tiny-dsv4", 16)],
)
def test_page_bytes_are_the_host_rows(preset, page_size):
    cfg = EngineConfig(
        preset=preset, page_size=page_size, max_total_tokens=256, enable_hierarchical_cache=True
    )
    engine = Engine(cfg)
    try:
        host = engine.side.prefix_cache.host
        mc = engine.model.cfg
        first = jax.tree_util.tree_leaves(engine.runner.cache)[0]
        dtype_bytes = np.dtype(first.dtype).itemsize  # the KV (latent, conv) dtype
        want = {L3_SUFFIX[kind]: pool.bytes_per_page for kind, pool in host.items()}
        assert page_bytes(mc, dtype_bytes, cfg.page_size) == want
        paged = sum(want.get(L3_SUFFIX[k], 0) for k in PAGED)
        assert read_bytes_per_token(mc, dtype_bytes, cfg.page_size) == paged / cfg.page_size
    finally:
        engine.close()


def test_quantized_kv_pages_count_their_own_bytes():
    """``--kv_cache_dtype=float8_e4m3fn``: KV pages at 1 byte a value, the recurrent state
    (conv inputs) still at the model's dtype: each equals the host rows the engine allocates."""
    cfg = EngineConfig(
        preset="tiny-mamba",
        page_size=8,
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        kv_cache_dtype="float8_e4m3fn",
    )
    engine = Engine(cfg)
    try:
        host = engine.side.prefix_cache.host
        mc = engine.model.cfg
        model_bytes = np.dtype(engine.model.dtype).itemsize
        assert model_bytes > 1
        want = {L3_SUFFIX[kind]: pool.bytes_per_page for kind, pool in host.items()}
        assert page_bytes(mc, model_bytes, cfg.page_size, kv_bytes=1) == want
        wide = page_bytes(mc, model_bytes, cfg.page_size)
        kv = [k for k in want if want[k] != wide[k]]
        assert kv and all(wide[k] == model_bytes * want[k] for k in kv)  # the KV kinds only
    finally:
        engine.close()
