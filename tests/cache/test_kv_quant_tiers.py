"""Quantized KV pages through every tier (issue 46).

- The two-pass L3 test with 8-bit pages for every family, under load: five prompts at once
  on a device pool and an L2 that cannot hold them together (pages leave L1 and L2 in the
  first pass), ``flush_cache``, three of them at once again. The second pass is served
  from L3 up to its last page (a chunk for recurrent models) and equals the first: both read
  the same quantized pages, so tokens match and logprobs agree to float32 noise, far inside
  what 8-bit KV itself moves them (checked against the unquantized run in
  ``test_dtypes_never_share_l3_pages``).
- Identity: engines whose pages differ in dtype share one L3 directory and never hit each
  other's pages; two with the same dtype do; ``storage.gc`` reports pages per dtype.
- Capacity at equal memory: device bytes per token, host pages at one ``hicache_size_gb``,
  L3 bytes per stored page; ``/server_info`` and ``/model_info`` report the dtype and bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.server.app import server_info
from hicache_jax.server.config import ServerConfig
from hicache_jax.server.state import ServerState
from hicache_jax.storage.codec import encode_page
from hicache_jax.storage.gc import Collector
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.cache.l3_helpers import P, hicache_llm, logprobs, prompt

CHUNK = 64  # hicache_llm's chunked_prefill_size
RECURRENT = {"tiny-mamba", "tiny-qwen3.5"}  # a state snapshot per chunk: up to a chunk recomputed
# One token: the prefill that reads the prefix from L3 decides it; no decode programs to
# compile (DeepSeek V4's take a minute here). Its top 5 logprobs are compared too. Decodes
# over quantized pages from L2 are in tests/engine/test_l2_pressure.py.
SAMPLING = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
TOP = 5
FP8, INT8 = "float8_e4m3fn", "int8"
# Float32 noise between two batchings of the same quantized pages (a prefill of 64 tokens
# against one of 16; a recurrent state recomputed from a snapshot): up to 3e-5 measured on
# most runs. The second pass also recomputes and writes again its uncached tail (up to a
# page, a chunk for recurrent models), where that noise can round an 8-bit value the other
# way (one e4m3 step is 1/16 to 1/8 of it): 1.2e-4 seen once under load (tiny-mla, e4m3).
# Reading unquantized pages instead moves them by far more (`test_dtypes_never_share_l3_pages`:
# over ten times this).
SAME_PAGES_ATOL = 1e-3


def top_logprobs(out: dict) -> np.ndarray:
    """[token, rank] -> logprob, the chosen token's own first (ranks by value: a near tie may
    swap two ids within the noise)."""
    meta = out["meta_info"]
    tops = [[lp for lp, _, _ in step] for step in meta["output_top_logprobs"]]
    return np.concatenate([logprobs(out)[:, None], np.asarray(tops)], axis=1)


def assert_same_pages_read(out: dict, ref: dict) -> None:
    assert out["output_ids"] == ref["output_ids"]
    np.testing.assert_allclose(top_logprobs(out), top_logprobs(ref), rtol=0, atol=SAME_PAGES_ATOL)


def model_kw(source: str, checkpoint_dir) -> dict:
    """A preset by name, or a random-weight transformers checkpoint of that family."""
    if source.startswith("tiny"):
        return {"preset": source}
    return {"model_path": checkpoint_dir(source), "dtype": "float32"}


# Dense (llama), sliding window (every layer), Gemma 3 (local/global, soft-capped logits),
# MoE, Mamba2 and Gated DeltaNet hybrids, MLA, DSA (MLA + indexer key pages), DeepSeek V4
# (window, compressed pages and compressor state); int8 for dense and a hybrid.
CASES = [
    ("llama", FP8),
    ("llama", INT8),
    ("tiny-swa", FP8),
    ("gemma3", FP8),
    ("tiny-moe", FP8),
    ("tiny-mamba", FP8),
    ("tiny-qwen3.5", FP8),
    ("tiny-qwen3.5", INT8),
    ("tiny-mla", FP8),
    ("tiny-dsa", FP8),
    ("tiny-dsv4", FP8),
]


@pytest.mark.parametrize("source,kv_dtype", CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_two_pass_l3_quantized_under_load(checkpoint_dir, tmp_path, source, kv_dtype):
    llm = hicache_llm(
        tmp_path / "l3",
        **model_kw(source, checkpoint_dir),
        kv_cache_dtype=kv_dtype,
        max_total_tokens=24 * P,  # one 17-page request fits; three do not
        hicache_ratio=2.5,  # 60 pages: the first pass's five prompts (80 pages) do not fit
        hicache_host_rate_limit=1.0,  # the second pass's three prefetches (45 pages) may all be in flight
    )
    assert llm.engine.storage.namespace.kv_dtype == kv_dtype
    prompts = [prompt(seed) for seed in range(5)]
    assert max(pool.size for pool in llm.engine.prefix_cache.host.values()) < 5 * 16

    def run(ids):
        return llm.generate(
            input_ids=ids, sampling_params=SAMPLING, return_logprob=True, top_logprobs_num=TOP
        )

    first = run(prompts)
    stats = llm.engine.metrics()
    assert all(out["meta_info"]["cached_tokens"] == 0 for out in first)
    assert stats["host_backups"] > 0 and stats["l3_writes"] > 0, stats
    assert llm.flush_cache().success
    llm.engine.check_integrity()
    # Three at once: their prefetches fit L2 together (a fourth's would be refused: L2 full).
    second = run(prompts[:3])
    max_uncached = CHUNK if source in RECURRENT else P
    for a, b, ids in zip(first, second, prompts):
        meta = b["meta_info"]
        assert meta["cached_tokens"] >= len(ids) - max_uncached, meta
        assert meta["cached_tokens_details"]["storage"] > 0, meta
        assert_same_pages_read(b, a)
    stats = llm.engine.metrics()
    assert stats["l3_checksum_failures"] == 0 and stats["prefetch_completed"] >= 3, stats
    llm.engine.check_integrity()
    llm.engine.close()


def page_dtypes_report(spec) -> dict:
    """``storage.gc``'s pages and bytes per KV dtype (the index rebuilt from a listing: these
    engines ran without a capacity limit, so kept no recency journal)."""
    store = TensorStoreL3(str(spec))
    gc = Collector(store, quiet=True)
    try:
        gc.rebuild()
        return gc.report()["kv_dtypes"]
    finally:
        gc.close()
        store.close()


def test_dtypes_never_share_l3_pages(tmp_path):
    """A float32 (auto on CPU), a bfloat16, an fp8 and an int8 engine on one L3 directory:
    none reads another's pages; a second fp8 engine reads the first's, and gets its logprobs back. gc
    reports each dtype's pages, at each dtype's bytes per page."""
    spec = tmp_path / "l3"
    ids = prompt(seed=11)

    def serve(kv_dtype):
        llm = hicache_llm(spec, preset="tiny", kv_cache_dtype=kv_dtype)
        out = llm.generate(
            input_ids=[ids], sampling_params=SAMPLING, return_logprob=True, top_logprobs_num=TOP
        )[0]
        llm.engine.close()  # drains its L3 writes
        return out, llm.engine.metrics()

    wide, _ = serve("auto")
    fp8, stats = serve("fp8_e4m3")  # SGLang's name
    assert fp8["meta_info"]["cached_tokens"] == 0 and stats["l3_reads"] == 0, stats
    # The float32 pages were not read: 8-bit keys and values move the logprobs far past the
    # float32 noise `assert_same_pages_read` allows.
    moved = np.abs(top_logprobs(fp8) - top_logprobs(wide)).max()
    assert moved > 10 * SAME_PAGES_ATOL, moved
    for other in ("bfloat16", INT8):  # int8: calibrated scales, its own scheme too
        out, stats = serve(other)
        assert out["meta_info"]["cached_tokens"] == 0 and stats["l3_reads"] == 0, (other, stats)
    again, stats = serve(FP8)
    meta = again["meta_info"]
    assert meta["cached_tokens_details"]["storage"] >= len(ids) - P, meta
    assert_same_pages_read(again, fp8)

    report = page_dtypes_report(spec)
    assert set(report) == {"float32", "bfloat16", FP8, INT8}, report
    pages = {d: r["pages"] for d, r in report.items()}
    assert len(set(pages.values())) == 1 and pages[FP8] >= len(ids) // P, pages
    # Stored objects: one fixed header and a payload of 1, 2 and 4 bytes a value (at these
    # widths the header is ~14% of an 8-bit page; `test_stored_page_bytes_at_llama_widths`).
    size = {d: r["bytes_per_page"] for d, r in report.items()}
    payload = size["bfloat16"] - size[FP8]
    assert size["float32"] - size["bfloat16"] == 2 * payload, size
    assert 0 < size[FP8] - payload <= 512 and size[INT8] == size[FP8], size


WIDE = ("float32", "bfloat16")
EIGHT_BIT = (FP8, "float8_e5m2")
# DeepSeek V4's compressor state pages keep float32 (a running pool, like a recurrent state),
# a fixed size per page: at 16-token pages its 8-bit total is 1.63x bfloat16's tokens (the
# compressed pages alone 2x); at 256-token pages (V4's pages hold whole HCA entries of 128)
# 1.96x, and 3.89x float32's.
OWN_DTYPE_STATE = {"tiny-dsv4": 256}


def pool_engine(preset: str, kv_dtype: str, page_size: int = P) -> Engine:
    """An engine that is built, never run (nothing compiles): pools and pages only."""
    return Engine(
        EngineConfig(
            preset=preset,
            kv_cache_dtype=kv_dtype,
            page_size=page_size,
            chunked_prefill_size=page_size,
            max_total_tokens=64 * page_size,
            enable_hierarchical_cache=True,
            hicache_size_gb=0.002,  # the same host memory for every dtype
        )
    )


@pytest.mark.parametrize(
    "preset",
    ["tiny", "tiny-swa", "tiny-moe", "tiny-mamba", "tiny-qwen3.5", "tiny-mla", "tiny-dsa", "tiny-dsv4"],
)
def test_eight_bit_pages_hold_more_tokens_at_equal_memory(preset):
    """Device KV bytes per token, host (L2) pages in one --hicache_size_gb and L3 bytes per
    stored page: 8-bit against float32 (>= 3.8x) and bfloat16 (>= 1.9x)."""
    engines = {d: pool_engine(preset, d) for d in (*WIDE, *EIGHT_BIT)}
    per_token = {d: e.runner.kv_bytes_per_token() for d, e in engines.items()}
    host_pages = {d: {k: h.size for k, h in e.prefix_cache.host.items()} for d, e in engines.items()}
    # A page's arrays as L2 holds them and L3 stores them (zeros: the codec's size is the shape's).
    layouts = {d: {k: h.layout for k, h in e.prefix_cache.host.items()} for d, e in engines.items()}
    for d, e in engines.items():
        assert str(e.model.kv_dtype) == d
        info = server_info(ServerState.from_engine(e, None, ServerConfig()), {})
        assert info["kv_cache_dtype"] == info["model_info"]["kv_cache_dtype"] == d
        assert info["kv_bytes_per_token"] == per_token[d]
        assert info["engine_config"]["kv_cache_dtype"] == d  # the flag as given
    for d in EIGHT_BIT:
        # (a share of) a page in 8 bits: the paged kinds; a recurrent state's slots keep theirs
        paged = [k for k, layout in layouts[d].items() if any(dt.itemsize == 1 for _, dt in layout.values())]
        assert paged, layouts[d]
        for kind in paged:
            for wide in WIDE:
                for n, (_, dt) in layouts[d][kind].items():  # 8-bit arrays were the wide dtype
                    assert layouts[wide][kind][n][1] == (np.dtype(wide) if dt.itemsize == 1 else dt), kind
            if all(dt.itemsize == 1 for _, dt in layouts[d][kind].values()):
                # L3: the same fixed header on a 1/2 (1/4) payload
                stored = {x: len(encode_page(_zeros(layouts[x][kind]), "0" * 16)) for x in (d, *WIDE)}
                header = {x: stored[x] - _payload(layouts[x][kind]) for x in stored}
                assert len(set(header.values())) == 1 and header[d] <= 512, (kind, stored)
                for wide in WIDE:
                    assert _payload(layouts[wide][kind]) == np.dtype(wide).itemsize * _payload(
                        layouts[d][kind]
                    )
        # L2 and L1: pages (tokens) in the same memory; a token needs a page of every paged kind
        tokens = {x: min(host_pages[x][k] for k in paged) for x in (d, *WIDE)}
        floor = 1.6 if preset in OWN_DTYPE_STATE else 1.9
        assert per_token["bfloat16"] >= floor * per_token[d], per_token
        assert tokens[d] >= floor * tokens["bfloat16"], tokens
        if preset not in OWN_DTYPE_STATE:
            assert per_token["float32"] >= 3.8 * per_token[d], per_token
            assert tokens[d] >= 3.8 * tokens["float32"], tokens
    if preset in OWN_DTYPE_STATE:  # the state's share at the family's own page size
        big = {x: pool_engine(preset, x, OWN_DTYPE_STATE[preset]) for x in (*WIDE, FP8)}
        per_token = {x: e.runner.kv_bytes_per_token() for x, e in big.items()}
        tokens = {x: min(h.size for h in e.prefix_cache.host.values()) for x, e in big.items()}
        for wide, floor in (("bfloat16", 1.9), ("float32", 3.8)):
            assert per_token[wide] >= floor * per_token[FP8], per_token
            assert tokens[FP8] >= floor * tokens[wide], tokens


def _zeros(layout: dict) -> dict:
    return {n: np.zeros(shape, dt) for n, (shape, dt) in layout.items()}


def _payload(layout: dict) -> int:
    return sum(int(np.prod(shape)) * dt.itemsize for shape, dt in layout.values())


def test_stored_page_bytes_at_llama_widths():
    """The codec's object for one page of Llama 3 8B (32 layers, K and V, 16 tokens, 8 KV heads
    of 128): its fixed header is < 0.1% of it, so 8-bit objects are >= 1.9x smaller than
    bfloat16's and >= 3.8x than float32's (at the tiny widths above, the same header is ~10%
    of an 8-bit page)."""
    shape = (32, 2, P, 8, 128)
    size = {
        d: len(encode_page({"kv": np.zeros(shape, dt)}, "0" * 16))
        for d, dt in {
            "float32": np.float32,
            "bfloat16": ml_dtypes.bfloat16,
            FP8: ml_dtypes.float8_e4m3fn,
            "int8": np.int8,
        }.items()
    }
    for d in (FP8, "int8"):
        assert size["bfloat16"] >= 1.99 * size[d] and size["float32"] >= 3.99 * size[d], size
