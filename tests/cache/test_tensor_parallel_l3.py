"""L2 and L3 under tensor parallelism: pages are stored whole, so a server at any tp_size
reads what another wrote. The two-pass test at tp 2, then the same L3 read at tp 1 and at
tp 4 (KV heads replicated there), each against a recompute at its own size, which in
turn gives the tokens and logprobs of tp 2. Those reads take four pages of each group into
the step, layer by layer (``models/page_loads.py``), split over the devices as the cache
is, KV heads repeated at tp 4."""

from tests.cache.l3_helpers import P, assert_same_as_recompute, hicache_llm, prompt, run, two_pass


def test_pages_written_at_tp2_serve_tp1_and_tp4(tmp_path):
    ids = prompt()
    first, second = two_pass(hicache_llm(tmp_path / "l3", tp_size=2), ids)
    assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - 2 * P, second["meta_info"]
    for tp in (1, 4):
        llm = hicache_llm(tmp_path / "l3", tp_size=tp, hicache_layerwise_pages=4)
        hit = run(llm, ids)
        meta = hit["meta_info"]
        assert meta["cached_tokens_details"]["storage"] >= len(ids) - 2 * P, (tp, meta)
        assert llm.engine.metrics()["host_loads_layerwise"] > 0
        # A new salt is another namespace: the same engine recomputes the prompt.
        fresh = run(llm, ids, cache_salt=f"recompute at tp {tp}")
        assert fresh["meta_info"]["cached_tokens"] == 0
        assert_same_as_recompute(hit, fresh)
        assert_same_as_recompute(fresh, first)  # tp sizes agree: greedy tokens, logprobs
        llm.engine.check_integrity()


def test_gdn_state_written_at_tp2_serves_tp1(tmp_path):
    """Gated DeltaNet state snapshots, whose conv state is split by channel over the devices
    (Mamba's is replicated), are stored whole too: written at tp 2 (and read back there by
    the two passes), they serve tp 1 with the tokens and logprobs of a recompute."""
    ids = prompt()
    gdn = dict(preset="tiny-qwen3.5")
    first, second = two_pass(hicache_llm(tmp_path / "l3", tp_size=2, **gdn), ids)
    assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - 2 * P, second["meta_info"]
    llm = hicache_llm(tmp_path / "l3", tp_size=1, **gdn)
    hit = run(llm, ids)
    assert hit["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - 2 * P, hit["meta_info"]
    fresh = run(llm, ids, cache_salt="recompute at tp 1")
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert_same_as_recompute(hit, fresh)
    assert_same_as_recompute(fresh, first)
    llm.engine.check_integrity()


def test_latent_and_indexer_pages_written_at_tp4_serve_tp1_layer_by_layer(tmp_path):
    """MLA latent and indexer pages are replicated over the devices (every head reads every
    row): written once at tp 4 (one copy per page, not one per device), they serve tp 1
    layer by layer, with a recompute's tokens and logprobs."""
    ids = prompt()
    dsa = dict(preset="tiny-dsa")
    first, second = two_pass(hicache_llm(tmp_path / "l3", tp_size=4, **dsa), ids)
    assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P, second["meta_info"]
    llm = hicache_llm(tmp_path / "l3", tp_size=1, hicache_layerwise_pages=4, **dsa)
    hit = run(llm, ids)
    assert hit["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P, hit["meta_info"]
    assert llm.engine.metrics()["host_loads_layerwise"] > 0
    fresh = run(llm, ids, cache_salt="recompute at tp 1")
    assert_same_as_recompute(hit, fresh)
    assert_same_as_recompute(fresh, first)
    llm.engine.check_integrity()


def test_dsv4_pages_written_at_tp4_serve_tp1_layer_by_layer(tmp_path):
    """DeepSeek V4's pages (window rows, compressed entries, indexer keys, compressor state)
    are replicated over the devices: written once at tp 4 (queries split by head, output
    groups' rows split over two devices each, experts one per device), they serve tp 1 layer
    by layer with a recompute's tokens and logprobs, every page boundary a valid prefix end."""
    ids = prompt()
    v4 = dict(preset="tiny-dsv4")
    first, second = two_pass(hicache_llm(tmp_path / "l3", tp_size=4, **v4), ids)
    assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P, second["meta_info"]
    llm = hicache_llm(tmp_path / "l3", tp_size=1, hicache_layerwise_pages=4, **v4)
    hit = run(llm, ids)
    assert hit["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P, hit["meta_info"]
    assert llm.engine.metrics()["host_loads_layerwise"] > 0
    fresh = run(llm, ids, cache_salt="recompute at tp 1")
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert_same_as_recompute(hit, fresh)
    assert_same_as_recompute(fresh, first)
    llm.engine.check_integrity()
