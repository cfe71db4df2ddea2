"""The two-pass L3 test over HTTP for the newer families, each from a random-weight
transformers checkpoint, with every tier on: a 16-page prompt, ``/flush_cache``, the same
prompt again served from L3 up to its last page, with the greedy tokens and, per token, a
KL of at most 1e-6 against a recompute (the same prompt under another ``cache_salt``,
which no tier holds). A recurrent family's prefix ends at a state snapshot: at a chunk
boundary or the prompt's last page boundary, so up to a chunk may be recomputed there."""

from __future__ import annotations

import numpy as np
import pytest

from tests.server.conftest import PAGE_SIZE, TEST_FLAGS, Server

CHUNK = 64  # TEST_FLAGS' chunked_prefill_size
RECURRENT = {"nemotron_h", "granite_h_moe", "qwen3_5", "qwen3_next"}
# Served with n-gram speculative decoding (issue 44): a sliding-window family, a Mamba2 and a
# Gated DeltaNet one. Every pass decodes with drafts from the prompt; the outputs must still
# equal the recompute's, and only accepted tokens reach the tiers.
SPECULATIVE = {"gpt_oss", "nemotron_h", "qwen3_5"}

SAMPLING = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def per_token_kl(out: dict, ref: dict) -> np.ndarray:
    lp = np.array([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    rf = np.array([x[0] for x in ref["meta_info"]["output_token_logprobs"]])
    r = lp - rf
    return np.exp(r) - 1 - r


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "olmo3",
        "gpt_oss",
        "nemotron_h",
        "granite_h_moe",
        "qwen3_5",
        "qwen3_next",
        # MLA latent pages; with the indexer's pages too (its top-k, 128, below the prompt).
        "deepseek_v3",
        "deepseek_v32",
        "glm_moe_dsa",
        # A window page, compressed pages and each page's compressor state (HCA: one entry a page).
        "deepseek_v4",
    ],
)
def test_two_pass_l3_over_http(checkpoint_dir, tmp_path, family):
    server = Server(
        "hicache_l3_cpu.flags",
        *TEST_FLAGS,
        f"--model_path={checkpoint_dir(family)}",
        "--dtype=float32",
        f"--hicache_storage_spec={tmp_path / 'l3'}",
        *(
            ["--speculative_algorithm=NGRAM", "--speculative_ngram_min_match_window_size=1"]
            if family in SPECULATIVE
            else []
        ),
        log_path=str(tmp_path / "server.log"),
    )
    try:
        ids = np.random.default_rng(7).integers(3, 500, size=16 * PAGE_SIZE).tolist()
        body = dict(input_ids=ids, sampling_params=SAMPLING, return_logprob=True)
        first = server.generate(**body)
        assert server.client.post("/flush_cache").json()["success"] is True
        second = server.generate(**body)
        meta = second["meta_info"]
        max_uncached = CHUNK if family in RECURRENT else PAGE_SIZE
        assert meta["cached_tokens"] >= len(ids) - max_uncached, meta
        assert meta["cached_tokens_details"]["storage"] > 0, meta
        fresh = server.generate(**body, cache_salt="recompute")
        assert fresh["meta_info"]["cached_tokens"] == 0
        for out in (first, second):
            assert out["output_ids"] == fresh["output_ids"]
            assert per_token_kl(out, fresh).max() <= 1e-6
        if family in SPECULATIVE:
            assert all(out["meta_info"]["spec_verify_ct"] > 0 for out in (first, second, fresh)), meta
    finally:
        server.close()
