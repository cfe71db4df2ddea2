"""Prefix reuse is exact: a multi-turn conversation with a shared system prefix and three
branches, run through the radix cache, gives the logprobs of a full recompute, and reuses
exactly the prefix the rules allow."""

import numpy as np
import pytest

from hicache_jax import LLM

P, CHUNK = 16, 32
SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def expected_cached(prompt, computed):
    """Longest page-aligned prefix shared with any sequence whose KV was computed, capped
    at input_len - 1 (the last prompt token is always recomputed)."""
    best = 0
    for seq in computed:
        n = 0
        for a, b in zip(prompt, seq):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // P * P


def per_token_kl(lp, ref):
    r = np.asarray(lp) - np.asarray(ref)
    return np.exp(r) - 1 - r  # KL estimate per sampled token


@pytest.mark.parametrize("family", ["mistral", "gemma3", "bamba", "qwen3", "qwen3_moe", "olmo3", "gpt_oss"])
def test_multiturn_branches_match_recompute(checkpoint_dir, family):
    path = checkpoint_dir(family)
    kw = dict(
        model_path=path, dtype="float32", page_size=P, chunked_prefill_size=CHUNK, max_running_requests=4
    )
    cached = LLM(**kw)
    fresh = LLM(**kw, disable_radix_cache=True)
    rng = np.random.RandomState(3)
    system = rng.randint(0, 512, 40).tolist()
    history = {b: list(system) for b in range(3)}
    computed = []  # sequences whose KV went into the tree: prompt + outputs but the last
    hits = []
    for turn in range(3):
        for b in range(3):
            prompt = history[b] + rng.randint(0, 512, 9 + 4 * b).tolist()
            out = cached.generate(input_ids=[prompt], sampling_params=SAMPLING, return_logprob=True)[0]
            ref = fresh.generate(input_ids=[prompt], sampling_params=SAMPLING, return_logprob=True)[0]
            assert ref["meta_info"]["cached_tokens"] == 0
            assert out["output_ids"] == ref["output_ids"], (turn, b)
            kl = per_token_kl(
                [x[0] for x in out["meta_info"]["output_token_logprobs"]],
                [x[0] for x in ref["meta_info"]["output_token_logprobs"]],
            )
            assert kl.max() <= 1e-6, (turn, b, kl.max())
            want = expected_cached(prompt, computed)
            got = out["meta_info"]["cached_tokens"]
            assert out["meta_info"]["cached_tokens_details"]["device"] == got
            if family == "bamba":  # a state snapshot exists at least once per chunk
                assert want - CHUNK <= got <= want, (turn, b, got, want)
            else:
                assert got == want, (turn, b, got, want)
            hits.append(got)
            computed.append(prompt + out["output_ids"][:-1])
            history[b] = prompt + out["output_ids"]
    assert sum(hits) > 0
    cached.engine.check_integrity()
