"""A long sliding-window request holds a window of pages; a full-attention one holds all."""

import dataclasses

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.presets import preset_config

P, W = 16, 32


def peak_pages(model_cfg, **kw):
    engine = Engine(
        EngineConfig(page_size=P, chunked_prefill_size=64, max_running_requests=2, **kw),
        model=CausalLM(model_cfg),
    )
    engine.add_request(
        input_ids=list(range(3, 43)), sampling_params={"max_new_tokens": 200, "ignore_eos": True}
    )
    peak = {k: 0 for k in engine.prefix_cache.pools}
    while engine.has_unfinished():
        engine.step()
        for kind, pool in engine.prefix_cache.pools.items():
            peak[kind] = max(peak[kind], pool.num_used)
    return peak


def test_sliding_request_holds_its_window_only():
    swa_cfg = preset_config("tiny-swa")  # every layer sliding, window 32
    full_cfg = dataclasses.replace(swa_cfg, layer_kinds=("attention",) * 2, sliding_window=None)
    total = 40 + 200
    # Without a prefix cache the request owns every page it uses.
    swa = peak_pages(swa_cfg, disable_radix_cache=True)["swa"]
    full = peak_pages(full_cfg, disable_radix_cache=True)["full"]
    # Full attention keeps all ceil(239 / 16) = 15 pages. A sliding request keeps the window
    # of its last page boundary (tokens b-31 .. b-1: 2 pages, 3 when b-31 is mid-page), the
    # page being written, and during a prefill chunk the chunk's pages.
    assert full == -(-(total - 1) // P) == 15
    assert swa <= (W - 1) // P + 3 == 4, swa
