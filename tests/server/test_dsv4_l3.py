"""The founding document's test for DeepSeek V4, over HTTP with every tier on: at the page
sizes its compression allows (128: one heavily compressed entry a page; 256), a sliding
window of 128 kept at a quarter of the full pools (``--swa_full_tokens_ratio 0.25``), L3
prefetch ``wait_complete``, and an indexer that picks 16 of up to 300 compressed entries.

A prefix may end at any page boundary: each page carries its compressors' state at its end
(``docs/architecture.md``), so after ``/flush_cache`` the second pass is served from L3 up to
its last page (``max_uncached`` is the page). Outputs equal a recompute (another
``cache_salt``) to a KL of 1e-6 per token. A prompt branching off the first one inside a
compressed sparse window and inside a heavily compressed one reuses the shared prefix up to
the page before the branch, and equals its own recompute."""

from __future__ import annotations

import numpy as np
import pytest

from tests import hf_checkpoints
from tests.server.conftest import Server
from tests.server.test_families_l3 import per_token_kl

SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory) -> str:
    overrides = {"compress_rates": RATES, "sliding_window": 128, "index_topk": 16}
    return hf_checkpoints.make("deepseek_v4", str(tmp_path_factory.mktemp("dsv4")), overrides=overrides)


@pytest.mark.parametrize("page", [128, 256])
def test_two_pass_l3_and_a_branch_inside_compression_windows(v4_checkpoint, tmp_path, page):
    server = Server(
        "hicache_l3_cpu.flags",
        f"--model_path={v4_checkpoint}",
        "--dtype=float32",
        f"--page_size={page}",
        "--chunked_prefill_size=512",
        "--max_running_requests=4",
        "--max_total_tokens=8192",
        "--swa_full_tokens_ratio=0.25",
        "--context_length=2048",
        "--log_level=info",
        f"--hicache_storage_spec={tmp_path / 'l3'}",
        log_path=str(tmp_path / "server.log"),
    )
    try:
        rng = np.random.default_rng(11)
        # 1,240 tokens: chunks of 512, 512 and 216, and what L3 leaves uncached (88 at page
        # 128, 216 at 256) fall in the step buckets the first pass compiled (516 and 256).
        ids = rng.integers(3, 500, size=1240).tolist()
        body = dict(input_ids=ids, sampling_params=SAMPLING, return_logprob=True)
        first = server.generate(**body)
        assert server.client.post("/flush_cache").json()["success"] is True
        second = server.generate(**body)
        meta = second["meta_info"]
        assert meta["cached_tokens"] >= len(ids) - page, meta
        assert meta["cached_tokens_details"]["storage"] >= page, meta
        fresh = server.generate(**body, cache_salt="recompute")
        assert fresh["meta_info"]["cached_tokens"] == 0
        for out in (first, second):
            assert out["output_ids"] == fresh["output_ids"]
            assert per_token_kl(out, fresh).max() <= 1e-6
        # Branch at 1001: inside a CSA window (1001 % 4 = 1) and an HCA window (1001 % 128 = 105).
        branch = ids[:1001] + rng.integers(3, 500, size=150).tolist()
        bbody = dict(input_ids=branch, sampling_params=SAMPLING, return_logprob=True)
        got = server.generate(**bbody)
        assert got["meta_info"]["cached_tokens"] == 1001 // page * page, got["meta_info"]
        solo = server.generate(**bbody, cache_salt="recompute")
        assert got["output_ids"] == solo["output_ids"]
        assert per_token_kl(got, solo).max() <= 1e-6
    finally:
        server.close()
