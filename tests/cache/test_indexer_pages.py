"""A sparse-attention layer's page is a hit only with its indexer page: SGLang's #30057
restored DSA latent pages from L3 without their indexer pages and answered from keys that
were never loaded. Here the latent and the indexer keys are separate cache kinds, each
needed for every page (``kinds.py``), so the prefix ends before the first page that lacks
either, in the prefetch and the match alike."""

import pytest

from hicache_jax.storage.keys import page_hashes
from hicache_jax.storage.layout import page_path
from tests.cache.l3_helpers import P, assert_same_as_recompute, hicache_llm, prompt, run


def _keys(llm, ids, kind: str, pages: range) -> list[str]:
    ns = llm.engine.storage.namespace
    hashes = page_hashes(ids[: len(ids) // P * P], P, ns)
    return [page_path(ns, hashes[j], kind) for j in pages]


@pytest.mark.parametrize("first_missing", [0, 8])
def test_latent_pages_without_their_indexer_pages_end_the_prefix(tmp_path, first_missing):
    llm = hicache_llm(tmp_path / "l3", preset="tiny-dsa")
    ids = prompt(seed=9)  # 16 pages, longer than the indexer's top-k: it picks
    first = run(llm, ids)
    assert llm.flush_cache().success  # L1 and L2 empty; every page in L3
    store = llm.engine.storage.client.store
    pages = range(first_missing, len(ids) // P)
    assert all(store.exists(_keys(llm, ids, "mla", pages))), "the latent pages are there"
    store.delete(_keys(llm, ids, "idx", pages))
    second = run(llm, ids)
    meta = second["meta_info"]
    assert meta["cached_tokens_details"]["storage"] == first_missing * P, meta
    assert_same_as_recompute(second, first)
    llm.engine.check_integrity()
    llm.engine.close()
