"""DeepSeek V4 under speculative decoding: outputs equal decoding without it, under load
(``test_speculative.check_outputs_equal``: n-gram and corrupted-oracle drafts, retractions,
L2 and L3 on).

What a rejected draft token would leave wrong is the compressors' state rows: each step
writes, in a ``csa_state`` / ``hca_state`` page's one row, the running windows after the
last token it fed there, which a later step starts from. A verify step writes the state
after each fed token but the last to a scratch page, and the one after the last accepted
token replaces the current page's (``CacheAdapter.after_verify``); a draft stays inside one
page, so the page-end rows are written by ordinary steps. The compressed entries, indexer
keys and window rows a rejected token wrote lie past the request's length and are written
again before a query reads them."""

from __future__ import annotations

from hicache_jax.kinds import PAGE_STATE
from tests.engine.test_speculative import check_outputs_equal


def test_dsv4_outputs_equal_decoding_without_speculation(tmp_path):
    swaps = []  # (kind, accepted, drafted) for each state page a rejection replaced

    def watch(engine):
        after_verify = engine.adapter.after_verify

        def counted(req, accepted):
            for kind, scratch in req.cache.trail_pages.items():
                if accepted < len(scratch):
                    swaps.append((kind, accepted, len(scratch)))
            after_verify(req, accepted)

        engine.adapter.after_verify = counted

    engine = check_outputs_equal("tiny-dsv4", tmp_path, watch, seed=3, all_tops=True)
    assert engine.adapter.page_states and set(engine.adapter.page_states) <= PAGE_STATE
    assert {k for k, _, _ in swaps} == set(engine.adapter.page_states)
    assert any(a > 0 for _, a, _ in swaps), "no partial draft: only rejected first tokens were rolled back"
