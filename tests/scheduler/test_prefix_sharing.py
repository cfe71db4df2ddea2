"""Prefixes shared within a batch are computed once: a waiting request whose prompt shares
pages with a running request's still-uncomputed prompt waits for them (``Scheduler._held``),
then takes them from the tree; the wait is bounded, and every step stays correct
(``sim.py``'s fake KV and ownership checks)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.request import Req
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler.scheduler import HOLD_SLACK
from tests.scheduler.sim import Setup, Sim, sampled_token

P = 4


def prompt_tokens_computed(sim: Sim, reqs: list[Req]) -> int:
    """Run to the end, checking every step; prompt tokens the steps computed."""
    computed = 0

    def count(plan):
        nonlocal computed
        for item in plan.items if plan else []:
            computed += max(0, min(item.end, item.req.input_len) - item.start)

    while sim.sched.has_work():
        sim.step(count)
        sim.check_ownership()
    for r in reqs:
        assert r.output_ids == [sampled_token(r.rid, i) for i in range(r.sampling.max_new_tokens)]
    return computed


def test_two_requests_with_a_ten_page_shared_prefix_compute_it_once():
    rng = np.random.RandomState(0)
    shared = rng.randint(3, 99, 10 * P).tolist()
    prompts = [shared + rng.randint(3, 99, 7).tolist() for _ in range(2)]
    sim = Sim(Setup(page_size=P, chunk=16, max_running=4, full_pages=64, max_pages=16))
    reqs = [sim.add(f"r{i}", p, 3) for i, p in enumerate(prompts)]  # arrive together
    computed = prompt_tokens_computed(sim, reqs)
    assert reqs[1].cached_tokens == 10 * P and reqs[1].held_steps > 0
    assert computed == 10 * P + 2 * 7  # the shared pages once, each suffix once


def test_the_wait_is_bounded_when_the_other_does_not_advance():
    sim = Sim(Setup(page_size=P, chunk=16, max_running=4, full_pages=64, max_pages=16))
    shared = list(range(3, 3 + 10 * P))
    stuck = Req(rid="stuck", input_ids=shared + [1, 2], sampling=SamplingParams())
    sim.sched.running.append(stuck)  # running, never computing (num_computed stays 0)
    waiter = Req(rid="w", input_ids=shared + [5], sampling=SamplingParams())
    limit = sim.sched.hold_limit(10 * P)
    assert limit == 2 * 3 + HOLD_SLACK  # 40 tokens: 3 chunks of 16
    assert [sim.sched._held(waiter, 0) for _ in range(limit + 3)] == [True] * limit + [False] * 3
    other_tenant = Req(rid="t", input_ids=shared + [5], sampling=SamplingParams(), cache_salt="t")
    assert not sim.sched._held(other_tenant, 0)  # no sharing across salts
    # matched as far as the shared pages go: nothing to wait for
    assert not sim.sched._held(Req(rid="m", input_ids=shared + [5], sampling=SamplingParams()), 10 * P)


group = st.tuples(
    st.lists(st.integers(3, 30), min_size=0, max_size=36),  # shared part
    st.lists(st.lists(st.integers(3, 30), min_size=1, max_size=12), min_size=1, max_size=4),  # suffixes
    st.integers(1, 6),  # max new tokens
)


@settings(max_examples=50, deadline=None)
@given(
    groups=st.lists(group, min_size=1, max_size=3),
    chunk=st.sampled_from([8, 16]),
    pages=st.sampled_from([16, 64]),
)
def test_random_shared_prefixes_finish_correctly_within_the_bound(groups, chunk, pages):
    """Groups arriving together, each sharing a prefix; a small pool (16 pages) forces
    retractions. Every step passes the fake-KV and ownership checks, every request ends
    with its own outputs, and no request waits past its bound."""
    sim = Sim(Setup(page_size=P, chunk=chunk, max_running=4, full_pages=pages, max_pages=16))
    reqs = [
        sim.add(f"g{g}_{j}", shared + suffix, max_new)
        for g, (shared, suffixes, max_new) in enumerate(groups)
        for j, suffix in enumerate(suffixes)
    ]
    prompt_tokens_computed(sim, reqs)
    assert len(sim.finished) == len(reqs)
    for r in reqs:
        assert r.held_steps <= sim.sched.hold_limit(r.input_len), r.rid
