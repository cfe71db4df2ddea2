"""Scheduler: FCFS admission, the prefill token budget and chunk ends, the running limit,
retraction of the newest under memory pressure, aborts; checked after every step of
generated traces, with the model step faked (``sim.py``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.request import Status
from tests.scheduler.sim import Setup, Sim, sampled_token

PREFIXES = [[100 + 10 * i + j for j in range(12)] for i in range(3)]  # shared system prompts


def expected_end(sim: Sim, start: int, seq_len: int, budget: int) -> int:
    chunk = sim.cfg.chunked_prefill_size
    return min(seq_len, start + budget, (start // chunk + 1) * chunk)


def checked_step(sim: Sim):
    """One step, and every scheduling rule checked against the state before it."""
    sched = sim.sched
    running = list(sched.running)
    waiting = list(sched.waiting)
    seq_len = {r: r.seq_len for r in running + waiting}
    outputs = {r: list(r.output_ids) for r in running}
    held_before = {r: r.held_steps for r in waiting}

    def held():
        """Waiting requests held this step for a shared prefix (``Scheduler._held``): the
        queue goes on past them, so FCFS is checked among the others."""
        return {r for r in waiting if r.held_steps > held_before[r]}

    def head_did_not_fit(plan):
        """Admission stopped with budget and a slot left: only because the head's pages did
        not fit (trying again, before the step frees anything, must fail too)."""
        items = plan.items if plan else []
        used = sum(i.num_tokens for i in items if not (i.req in running and i.num_tokens == 1 and i.samples))
        budget = sim.cfg.chunked_prefill_size - used
        unheld = [r for r in sched.waiting if r not in held()]
        if unheld and len(sched.running) < sim.cfg.max_running_requests and budget > 0:
            head = unheld[0]
            match = sim.adapter.match(head)
            end = sched.chunk_end(head, match.end, budget)
            assert not sim.adapter.admit(head, match, end), f"{head.rid} fits but waits"

    plan = sim.step(head_did_not_fit)
    items = {i.req: i for i in (plan.items if plan else [])}
    assert len(items) == len(plan.items if plan else []), "a request twice in one step"
    assert len(sched.running) <= sim.cfg.max_running_requests

    # Retraction takes the newest running requests: a suffix of the running list.
    retracted = [r for r in running if r.status is Status.WAITING]
    assert running[len(running) - len(retracted) :] == retracted, "retracted a request older than one kept"
    for r in retracted:
        assert r not in items and r.output_ids == outputs[r], "a retracted request keeps its outputs"
        assert r.num_computed == 0 and not r.cache.num_pages
    if running:  # the oldest always advances (liveness)
        assert plan is not None and plan.items[0].req is running[0]

    # The budget: decodes are free, prefill chunks share chunked_prefill_size, in order.
    budget = sim.cfg.chunked_prefill_size
    order = [r for r in running if r not in retracted]
    for r in order:
        item = items.get(r)
        decode = seq_len[r] - r.num_computed == 1 if item is None else item.start == seq_len[r] - 1
        if r.status is Status.FINISHED and item is None:
            raise AssertionError(f"{r.rid} finished without a step")
        if decode:
            assert item is not None and item.num_tokens == 1, f"decode of {r.rid} skipped"
            continue
        if budget <= 0:
            assert item is None, f"{r.rid} prefilled past the budget"
            continue
        assert item is not None, f"{r.rid} skipped with budget {budget} left"
        assert item.end == expected_end(sim, item.start, seq_len[r], budget), (item.start, item.end, budget)
        budget -= item.num_tokens
    admitted = [i.req for i in (plan.items if plan else []) if i.req not in running]
    assert [i.req for i in (plan.items if plan else [])] == [r for r in order if r in items] + admitted
    for r in admitted:
        item = items[r]
        assert budget > 0, "admitted with no budget left"
        assert item.start % sim.P == 0 and item.start < seq_len[r], (
            "a match ends at a page, before the last token"
        )
        assert item.end == expected_end(sim, item.start, seq_len[r], budget)
        budget -= item.num_tokens

    # FCFS: the admitted are the head of the queue (retracted requests first, then arrival
    # order), held requests aside.
    waits = held()
    assert all(r.held_steps <= sched.hold_limit(r.input_len) for r in waits), "held past the bound"
    queue = [r for r in admitted + list(sched.waiting) if r not in waits]
    assert [r for r in queue if r not in retracted] == [r for r in waiting if r not in waits]
    first_new = next((k for k, r in enumerate(queue) if r not in retracted), len(queue))
    assert all(r in retracted for r in queue[:first_new]) and not set(retracted) & set(queue[first_new:])
    sim.check_ownership()
    return plan


def prompt_for(rng: random.Random, shared: int | None, length: int) -> list[int]:
    head = PREFIXES[shared][: min(length, 12)] if shared is not None else []
    return head + [rng.randrange(3, 1000) for _ in range(length - len(head))]


TRACE = st.lists(
    st.tuples(
        st.integers(0, 6),  # arrival step
        st.one_of(st.none(), st.integers(0, 2)),  # shared prefix
        st.integers(1, 36),  # prompt tokens
        st.integers(1, 10),  # new tokens
        st.one_of(st.none(), st.integers(0, 30)),  # abort at this step (if still unfinished)
    ),
    min_size=1,
    max_size=10,
)
SETUPS = {
    "full": Setup(),
    "tight": Setup(full_pages=13, chunk=8, max_running=3),  # retracts
    "swa": Setup(full_pages=16, window=6, swa_pages=14),
    "host": Setup(full_pages=14, host_pages=24),
}


@pytest.mark.parametrize("name", sorted(SETUPS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(trace=TRACE, repeat=st.booleans())
def test_generated_traces(name, trace, repeat):
    sim = Sim(SETUPS[name])
    rng = random.Random(0)
    arrivals = sorted(enumerate(trace), key=lambda x: x[1][0])
    reqs, prompts = {}, []
    bound = 20 * sum(t[2] + t[3] for t in trace) + 50  # steps: every request finishes well within
    for step in range(bound):
        while arrivals and arrivals[0][1][0] <= step:
            i, (_, shared, length, new, _) = arrivals.pop(0)
            ids = (
                prompts[i % len(prompts)] if repeat and prompts and i % 2 else prompt_for(rng, shared, length)
            )
            prompts.append(ids)
            reqs[i] = sim.add(str(i), ids, new)
        for i, (_, _, _, _, abort_at) in enumerate(trace):
            r = reqs.get(i)
            if abort_at == step and r is not None and r.status is not Status.FINISHED:
                assert sim.sched.abort(r.rid) is r
                r.status = Status.FINISHED
                sim.aborted.append(r)
                sim.check_ownership()
        if not arrivals and not sim.sched.has_work():
            break
        checked_step(sim)
    else:
        raise AssertionError(
            f"not done in {bound} steps: {len(sim.sched.running)} running, {len(sim.sched.waiting)} waiting"
        )
    for r in sim.finished:
        assert r.output_ids == [sampled_token(r.rid, k) for k in range(r.sampling.max_new_tokens)]
    assert len(sim.finished) + len(sim.aborted) == len(trace)
    sim.check_ownership()
    for kind, pool in sim.cache.pools.items():
        assert pool.num_used == len(sim.cache.tree_indices()[kind]), "pages outlived every request"


def test_fcfs_and_running_limit():
    sim = Sim(Setup(chunk=64, max_running=2))
    same, other = [3 + k for k in range(8)], [30 + k for k in range(8)]
    a, b, c = (sim.add(x, p, 3) for x, p in zip("abc", (same, other, same)))
    plan = checked_step(sim)
    assert [i.req for i in plan.items] == [a, b] and list(sim.sched.waiting) == [c]
    while sim.sched.has_work():
        checked_step(sim)
    assert [r.rid for r in sim.finished] == ["a", "b", "c"]
    assert sim.finished[2].cached_tokens == 4  # c matched a's first page (its last token is recomputed)


def test_chunked_prefill_ends_at_chunk_boundaries():
    sim = Sim(Setup(chunk=8))
    sim.add("long", list(range(3, 30)), 1)  # 27 tokens
    ends = []
    while sim.sched.has_work():
        ends.append(checked_step(sim).items[0].end)
    assert ends == [8, 16, 24, 27]


def test_retraction_takes_the_newest_and_it_finishes_the_same():
    # 12 pages: two 20-token prompts (5 pages each) growing by 16 tokens cannot both fit.
    sim = Sim(Setup(full_pages=12, chunk=64))
    old = sim.add("old", list(range(3, 23)), 16)
    new = sim.add("new", list(range(50, 70)), 16)
    while sim.sched.has_work():
        checked_step(sim)
    assert sim.sched.num_retractions >= 1 and new.retractions >= 1 and old.retractions == 0
    assert [r.rid for r in sim.finished] == ["old", "new"]
    for r in (old, new):
        assert r.output_ids == [sampled_token(r.rid, k) for k in range(16)]
        # The prompts share nothing: what a resumed request finds is what it computed itself.
        assert r.cached_tokens == 0 and sum(r.cached_details.values()) == 0, r.cached_details


def test_abort_frees_pages_of_running_and_waiting():
    sim = Sim(Setup(max_running=1, chunk=64))
    a = sim.add("a", list(range(3, 40)), 8)  # 37 tokens: 9 pages go to the tree, 1 stays its own
    b = sim.add("b", list(range(50, 60)), 8)
    checked_step(sim)
    assert sim.sched.running == [a] and list(sim.sched.waiting) == [b]
    own = sum(a.cache.own["full"])
    assert own == 1
    used = sim.cache.pools["full"].num_used
    assert sim.sched.abort("a") is a and sim.sched.abort("b") is b and sim.sched.abort("zz") is None
    sim.aborted += [a, b]
    assert not sim.sched.has_work() and sim.sched.queued_tokens == 0
    sim.check_ownership()  # also: no lock outlives the aborted request
    assert sim.cache.pools["full"].num_used == used - own


def test_drop_all_releases_every_running_request_and_caches_nothing_new():
    """The engine's failed-step path: running requests are dropped (their device pages are
    suspect), so the tree gains nothing and every page they held is free again."""
    sim = Sim(Setup(max_running=2, chunk=64))
    a, b = sim.add("a", list(range(3, 40)), 8), sim.add("b", list(range(50, 70)), 8)
    checked_step(sim)
    checked_step(sim)
    assert sim.sched.running == [a, b]
    tree_pages = len(sim.cache.tree_indices()["full"])
    dropped = sim.sched.drop_all()
    assert dropped == [a, b] and not sim.sched.running and not sim.sched.has_work()
    sim.aborted += dropped
    sim.check_ownership()
    assert len(sim.cache.tree_indices()["full"]) == tree_pages
    assert sim.cache.pools["full"].num_used == tree_pages  # nothing held outside the tree
