"""DeepSeek V4 with L2 gives the outputs it gives without, under retraction.

Each cache kind has its own device pool. Without L2 they hand out pages alike; with L2 a
node can keep one kind on the device and another only on the host (evictions and loads
act per kind), so a request's indexer-key pages (``index``) and compressed-entry pages
(``csa``) get different indices. A CSA layer wrote its indexer's keys at the entries'
slots rather than at its own pool's, into other requests' pages or free ones, and the
indexer then picked entries by stale keys: with L2 on, 1 to 3 of 8 requests differed from
L2 off (``test_speculative``'s workload, seeds 0 to 6), even a fresh request's first
tokens.
"""

from __future__ import annotations

import numpy as np

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.kinds import CacheKind
from tests.engine.test_speculative import BASE, run, workload

PRESET = "tiny-dsv4"
# 4 running requests: the workload below then gets index and csa pages apart (at 8 it does
# not). Both tests run with it, so the one-request test's step programs are the other's.
LIMITS = BASE | dict(max_running_requests=4)


def _logprobs(out) -> np.ndarray:
    return np.array([x[0] for x in out["meta_info"]["output_token_logprobs"]])


def test_indexer_keys_follow_their_own_pool():
    """One request on an engine whose indexer-key pool hands out other indices than the
    entries' pool (high ones first: all taken, then given back in order): the same outputs
    and logprobs as on a fresh one.
    The prompt is longer than the indexer keeps (8 entries, 32 tokens), so its keys pick."""
    prompt = np.random.RandomState(0).randint(3, 500, 70).tolist()
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    cfg = EngineConfig(preset=PRESET, **LIMITS)
    want = run(Engine(cfg), [prompt], [params], all_tops=True)[0]
    skewed = Engine(cfg)
    pool = skewed.prefix_cache.pools[CacheKind.INDEX]
    pool.free(pool.alloc(pool.size))
    got = run(skewed, [prompt], [params], all_tops=True)[0]
    assert got["output_ids"] == want["output_ids"]
    np.testing.assert_allclose(_logprobs(got), _logprobs(want), atol=1e-5)


def test_l2_on_gives_l2_off_outputs_under_retraction():
    """``test_speculative``'s workload (seed 3) on 4 running requests, without speculation:
    L2 on and off give the same outputs; and with L2 on the two pools did diverge (else
    this workload no longer tests the case)."""
    prompts, params = workload(3)
    want = run(Engine(EngineConfig(preset=PRESET, **LIMITS)), prompts, params, all_tops=True)
    engine = Engine(EngineConfig(preset=PRESET, enable_hierarchical_cache=True, hicache_ratio=2.0, **LIMITS))
    diverged = []
    step = engine.step

    def step_and_look():
        step()
        diverged.extend(
            r.rid
            for r in engine.scheduler.running
            if r.cache.pages.get(CacheKind.INDEX) != r.cache.pages.get(CacheKind.CSA)
        )

    engine.step = step_and_look
    got = run(engine, prompts, params, all_tops=True)
    assert diverged, "no request's index and csa pages differed: the workload no longer tests this"
    assert engine.scheduler.num_retractions > 0, "the pool was meant to force retractions"
    bad = [i for i, (w, g) in enumerate(zip(want, got)) if w["output_ids"] != g["output_ids"]]
    assert not bad, f"requests {bad} differ with L2 on"
