"""The overlap schedule with a drafter: a decode step that would not verify whatever its
drafts (``draft_policy.wont_verify``) is planned while the step before it runs, without
drafts, and outputs stay those of decoding without speculation.

One engine serves two waves. The first is under load: more requests than run at once, a
pool small enough to retract, L2 on. Look-ahead needs a free page per running request,
which a pool full of cached prefixes does not have (with speculation or without), so the
second wave, after ``flush_cache``, is where steps go ahead.

The prompts repeat a motif, so the n-gram drafter proposes, but the tiny presets' random
weights rarely continue it (nor does a random MTP block guess the next tokens): drafts
fail, requests stop counting, and most decode steps go ahead. Their probes still come: no
request goes more than ``PROBE_EVERY`` steps with a draft, or planned ahead, without a
verify step (the policy's bound without look-ahead)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.scheduler.draft_policy import PROBE_EVERY

BASE = dict(
    preset="tiny",
    page_size=16,
    chunked_prefill_size=64,
    max_running_requests=4,
    max_total_tokens=16 * 16,  # 6 requests of up to 110 tokens, 4 running: some are retracted
    dtype="float32",
)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        motif = rng.randint(3, 500, rng.randint(4, 10)).tolist()
        out.append(rng.randint(3, 500, rng.randint(5, 20)).tolist() + motif * rng.randint(2, 4))
    return out


def run(engine: Engine, ids: list[list[int]]) -> list[dict]:
    sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p in ids]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return [engine.pop_output(r) for r in rids]


def waves(engine: Engine) -> list[dict]:
    """Six requests, then, the cache flushed, two."""
    first = run(engine, prompts(6, seed=0))
    retractions = engine.scheduler.num_retractions
    assert engine.flush_cache().success
    return first + run(engine, prompts(2, seed=1)), retractions


class Watch:
    """Per request, steps in a row since its last verify step in which it had a draft
    without a verify step, or was planned ahead (``quiet``, the policy's ``idle``), and their
    most; the steps planned ahead and the verify steps that follow one (probes)."""

    def __init__(self, engine: Engine):
        self.proposed: set[str] = set()  # requests with a draft proposed for the step being planned
        self.quiet: dict[str, int] = {}
        self.most = self.ahead = self.probes = 0
        self.after_ahead = False
        drafter, launch, proposed = engine.drafter, engine._launch, self.proposed

        class Watched(type(drafter)):  # still the engine's kind of drafter (MtpDrafter matters)
            def __call__(self, req, k):
                draft = super().__call__(req, k)
                if draft:
                    proposed.add(req.rid)
                return draft

        def watched(plan, prev):
            self.step(plan, ahead=prev is not None)
            return launch(plan, prev)

        engine.drafter, engine._launch = Watched.__new__(Watched), watched
        engine.drafter.__dict__.update(vars(drafter))

    def step(self, plan, ahead: bool) -> None:
        verify = plan.verify
        for item in plan.items:
            rid = item.req.rid
            if item.draft:
                self.quiet[rid] = 0
            elif ahead or (rid in self.proposed and not verify):
                self.quiet[rid] = self.quiet.get(rid, 0) + 1
        self.most = max([self.most, *self.quiet.values()])
        self.ahead += ahead
        self.probes += verify and self.after_ahead
        self.after_ahead = ahead or (self.after_ahead and not verify)
        self.proposed.clear()


@pytest.mark.parametrize(
    "preset,algorithm",
    [("tiny", "NGRAM"), ("tiny-mla-mtp", "NEXTN")],  # MTP: the block drafts in a step planned ahead too
)
def test_steps_that_would_not_verify_run_ahead_and_outputs_equal_no_speculation(preset, algorithm):
    base = BASE | {"preset": preset}
    want, _ = waves(Engine(EngineConfig(**base)))
    engine = Engine(
        EngineConfig(
            **base,
            speculative_algorithm=algorithm,
            speculative_num_draft_tokens=4,
            speculative_ngram_min_match_window_size=1,
            enable_hierarchical_cache=True,
            hicache_ratio=2.0,
        )
    )
    watch = Watch(engine)
    got, retractions = waves(engine)
    for a, b in zip(want, got, strict=True):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
    st = engine.stats
    assert retractions > 0, "the pool was meant to force retractions"
    assert st["spec_accepted_tokens"] < st["spec_draft_tokens"] / 2, "the drafts were meant to fail"
    assert st["overlapped_steps"] == watch.ahead > 20, (st, watch.ahead)
    assert watch.probes > 0, "no verify step came after a step planned ahead"
    assert 0 < watch.most <= PROBE_EVERY, watch.quiet


def test_at_the_default_min_match_requests_that_cannot_draft_next_run_ahead():
    """SGLang's default n-gram window (3 tokens) on prompts that repeat nothing: a request
    whose last two tokens occur nowhere earlier can draft after no next token
    (``NgramIndex.can_follow``), so it is not due to probe, and its steps go ahead from the
    first; outputs are those of decoding without speculation."""
    rng = np.random.RandomState(2)
    ids = [rng.permutation(np.arange(3, 500))[:40].tolist() for _ in range(2)]  # no token twice
    want = run(Engine(EngineConfig(**BASE)), ids)
    engine = Engine(EngineConfig(**BASE, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4))
    assert engine.cfg.speculative_ngram_min_match_window_size == 3
    got = run(engine, ids)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert engine.stats["overlapped_steps"] > 10, engine.stats
