"""Choices of one prompt (``Req.after``): a follower is admitted only once the request it
follows has computed the prompt, and then takes the prompt's pages from the tree; checked
every step of generated traces (``sim.py``), under memory pressure too."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.request import Status
from tests.scheduler.sim import Setup, Sim, sampled_token


def run(sim: Sim, groups: list[tuple[list[int], int, int]]) -> dict:
    """Queue each (prompt, n, max_new) as a leader and n - 1 followers, all at once; run to
    the end, checking the admission rule and page ownership every step. The followers'
    ``Req``s, by group."""
    followers, lead_of = {}, {}
    for g, (prompt, n, max_new) in enumerate(groups):
        lead = sim.add(f"g{g}_0", prompt, max_new)
        followers[g] = [sim.add(f"g{g}_{j}", prompt, max_new) for j in range(1, n)]
        for r in followers[g]:
            r.after = lead_of[r] = lead

    def admitted_late(plan) -> None:
        for r in sim.sched.running:
            lead = lead_of.get(r)
            assert lead is None or lead.output_ids or lead.status is Status.FINISHED, f"{r.rid} ran first"

    while sim.sched.has_work():
        sim.step(admitted_late)
        sim.check_ownership()
    for r in sim.finished:
        assert r.output_ids == [sampled_token(r.rid, i) for i in range(r.sampling.max_new_tokens)]
    return followers


group = st.tuples(
    st.lists(st.integers(3, 99), min_size=1, max_size=40), st.integers(2, 4), st.integers(1, 12)
)


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(group, min_size=1, max_size=4), chunk=st.sampled_from([8, 16, 64]))
def test_followers_wait_for_the_prompt_then_share_it(groups, chunk):
    sim = Sim(Setup(page_size=4, chunk=chunk, max_running=4, full_pages=256, max_pages=16))
    followers = run(sim, groups)  # room for every request at once: nothing is evicted
    assert len(sim.finished) == sum(n for _, n, _ in groups)
    for g, (prompt, _, _) in enumerate(groups):
        for r in followers[g]:
            assert r.cached_tokens == (len(prompt) - 1) // 4 * 4, (r.rid, r.cached_tokens)


@settings(max_examples=30, deadline=None)
@given(groups=st.lists(group, min_size=2, max_size=4))
def test_under_memory_pressure(groups):
    """A pool of 14 pages: leaders and followers are retracted and resume; all finish."""
    sim = Sim(Setup(page_size=4, chunk=16, max_running=4, full_pages=14, max_pages=14))
    run(sim, groups)
    assert len(sim.finished) == sum(n for _, n, _ in groups)
