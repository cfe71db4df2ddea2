"""Speculative decoding gives the outputs of decoding without it, token for token, greedy
or sampled, for every family, under load: concurrent requests on a pool small enough to
retract, every tier on, stop tokens and ``max_new_tokens`` falling inside a draft,
``min_new_tokens``, penalties, logprobs. Nothing leaks (the cache's integrity is checked
after every step).

Two drafters in one engine: the n-gram drafter the flag selects, for half the requests,
and for the others an oracle that proposes the request's true continuation (from the run
without speculation) with a token replaced at random half the time, so that whole drafts,
partial drafts and rejected first tokens all occur, which random weights would rarely give
the n-gram drafter."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.engine.engine import Engine

WIDTH = 4  # tokens a request feeds per verify step
BASE = dict(
    page_size=16,
    chunked_prefill_size=64,
    max_running_requests=8,
    max_total_tokens=10 * 16,  # 8 requests of 35 to 96 tokens: some are retracted
    dtype="float32",
)


def workload(seed: int = 0):
    """Prompts with repeats (so the n-gram drafter finds matches) and a prefix shared by
    some; settings mixing greedy and sampled rows, stop tokens and short limits."""
    rng = np.random.RandomState(seed)
    shared = rng.randint(3, 500, 20).tolist()
    prompts, params = [], []
    for i in range(8):
        motif = rng.randint(3, 500, rng.randint(4, 12)).tolist()
        prompts.append(shared[: rng.randint(0, 20)] + motif * rng.randint(2, 5))
        sp = {"max_new_tokens": int(rng.randint(5, 40)), "seed": i, "ignore_eos": True}
        if i % 3:
            sp.update(temperature=0.9, top_k=40)
        else:
            sp.update(temperature=0.0)
        if i == 4:  # likely hit mid-draft, once min_new_tokens lets it
            sp.update(stop_token_ids=[int(x) for x in rng.randint(3, 500, 15)], min_new_tokens=4)
        if i in (2, 6):  # each drafted row is penalised with the draft tokens before it
            sp.update(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
        if i in (3, 6):  # each drafted row is masked with the grammar advanced over the draft
            sp["regex"] = r"(yes|no|maybe)( [a-z]{1,6}){2,9}\."
        params.append(sp)
    return prompts, params


def run(engine: Engine, prompts, params, all_tops: bool = False, logprob_start_len: int = -1):
    """Each request's outputs with logprobs; request 1's with its top 2 too, or with
    ``all_tops`` every request's: then every step computes top logprobs, one program per
    step shape rather than one with and one without (``assert_same`` compares them all).
    ``logprob_start_len``: each request's, for prompt logprobs."""
    rids = [
        engine.add_request(
            input_ids=p,
            sampling_params=sp,
            return_logprob=True,
            top_logprobs_num=2 * (all_tops or i == 1),
            logprob_start_len=logprob_start_len,
        )
        for i, (p, sp) in enumerate(zip(prompts, params))
    ]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return [engine.pop_output(r) for r in rids]


class Mixed:
    """The engine's n-gram drafter for odd-numbered prompts; for the others, an oracle:
    the true continuation with one token replaced half the time (seeded)."""

    def __init__(self, ngram, prompts, want, seed: int = 1):
        self.ngram, self.rng = ngram, random.Random(seed)
        self.truth = {tuple(p): (i, w["output_ids"]) for i, (p, w) in enumerate(zip(prompts, want))}
        self.ngram_tokens = 0

    def __call__(self, req, k: int) -> list[int]:
        i, truth = self.truth[tuple(req.input_ids)]
        if i % 2:
            draft = self.ngram(req, k)
            self.ngram_tokens += len(draft)
            return draft
        req.drafter_state = req.drafter_state or "oracle"
        return corrupted(truth, len(req.output_ids), k, self.rng)

    def may_draft_next(self, req) -> bool:
        i, _ = self.truth[tuple(req.input_ids)]
        return self.ngram.may_draft_next(req) if i % 2 else True  # the oracle always drafts


def corrupted(truth: list[int], n: int, k: int, rng: random.Random) -> list[int]:
    """The ``k`` true tokens after the first ``n``, one replaced at random half the time."""
    draft = list(truth[n : n + k])
    if draft and rng.random() < 0.5:
        draft[rng.randrange(len(draft))] = rng.randrange(3, 500)
    return draft


def assert_same(want: list[dict], got: list[dict]) -> None:
    for a, b in zip(want, got):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(lp_b, lp_a, atol=2e-4)
        if a["meta_info"].get("output_top_logprobs"):
            tops_a = [[t[1] for t in row] for row in a["meta_info"]["output_top_logprobs"]]
            tops_b = [[t[1] for t in row] for row in b["meta_info"]["output_top_logprobs"]]
            assert tops_b == tops_a


@pytest.mark.parametrize(
    "preset",
    ["tiny", "tiny-swa", "tiny-gpt-oss", "tiny-moe", "tiny-mamba", "tiny-qwen3.5", "tiny-mla", "tiny-dsa"],
)
def test_outputs_equal_decoding_without_speculation(preset, tmp_path):
    check_outputs_equal(preset, tmp_path, all_tops=True)


def check_outputs_equal(
    preset: str, tmp_path, watch=None, seed: int = 0, all_tops: bool = False, **config
) -> Engine:
    """The outputs of ``workload(seed)`` with speculation (``Mixed`` drafts) equal those
    without, on ``preset`` (``config``: settings other than ``BASE``'s); drafts were
    accepted and rejected, and requests retracted. ``watch``: called with the speculating
    engine before it runs; ``all_tops``: ``run``'s. Returns that engine."""
    prompts, params = workload(seed)
    base = BASE | config
    want = run(Engine(EngineConfig(preset=preset, **base)), prompts, params, all_tops)
    spec = EngineConfig(
        preset=preset,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=WIDTH,
        speculative_ngram_min_match_window_size=1,  # random weights rarely repeat 3 tokens
        enable_hierarchical_cache=True,  # every tier on: retracted prefixes come back from L2
        hicache_ratio=2.0,
        hicache_storage_backend="tensorstore",
        hicache_storage_spec=str(tmp_path / "l3"),
        **base,
    )
    engine = Engine(spec)
    engine.drafter = drafter = Mixed(engine.drafter, prompts, want)
    if watch is not None:
        watch(engine)
    try:
        got = run(engine, prompts, params, all_tops)
    finally:
        engine.close()
    assert_same(want, got)
    st = engine.stats
    assert drafter.ngram_tokens > 0
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    assert engine.scheduler.num_retractions > 0, "the pool was meant to force retractions"
    assert max(g["meta_info"]["spec_accept_length"] for g in got) > 2
    metrics = engine.metrics()
    assert metrics["spec_accept_length"] == pytest.approx(
        (st["spec_accepted_tokens"] + st["spec_verifications"]) / st["spec_verifications"]
    )
    return engine


def test_unsupported_speculation_is_refused_naming_the_flag():
    for bad, field in [
        (dict(speculative_algorithm="EAGLE3"), "speculative_algorithm"),
        (
            dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/x"),
            "speculative_draft_model_path",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1), "speculative_num_draft_tokens"),
    ]:
        with pytest.raises(ConfigError, match=field):
            EngineConfig(**bad)
