"""The draft policy: a step verifies only when its drafts are expected to pay for the verify
step's rows; a request whose drafts are rejected stops counting and probes again later; one
whose drafts are accepted keeps drafting its full width. A step the overlap schedule plans
ahead (without drafts: ``wont_verify``) is one that would not have verified, and planning
ahead moves no probe.

The engine's side is simulated as ``Engine._results`` counts: a request fed a draft in a
verify step gets one more ``spec_verifications`` and its accepted tokens in
``spec_accepted_tokens``."""

from __future__ import annotations

import copy
import math
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.request import Req
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler import draft_policy
from hicache_jax.scheduler.draft_policy import (
    PROBE_EVERY,
    needed,
    planned_ahead,
    wont_verify,
    worth_verifying,
)
from hicache_jax.scheduler.drafts import add_drafts
from hicache_jax.scheduler.plan import StepPlan, WorkItem

WIDTH = 4


def new_req(i: int = 0) -> Req:
    return Req(f"r{i}", list(range(3, 40)), SamplingParams(max_new_tokens=1000))


def run(trace, batch: int, width: int = WIDTH) -> list[bool]:
    """Steps of ``batch`` requests, each with a full draft every step; ``trace(step, i)``:
    the draft tokens request ``i`` would have accepted at ``step``. Returns, per step,
    whether it verified."""
    reqs = [new_req(i) for i in range(batch)]
    verified = []
    for step in range(len(trace)):
        drafts = {r: [7] * (width - 1) for r in reqs}
        verify = worth_verifying(drafts, batch, width)
        if verify:
            for i, r in enumerate(reqs):
                r.spec_verifications += 1
                r.spec_accepted_tokens += min(trace[step][i], width - 1)
        verified.append(verify)
    return verified


def test_the_needed_tokens_are_where_a_verify_step_breaks_even():
    """``needed`` against the cost model recomputed: tokens per unit of cost, decode step
    (``S`` rows) against verify step (``S x W`` rows), each plus the step's fixed cost."""
    for overhead in (0.0, 12.0, 500.0):
        for batch in range(1, 9):
            for width in (2, 4, 8):
                seqs = 1 << (batch - 1).bit_length()
                a = needed(batch, width, overhead)
                decode = batch / (overhead + seqs)
                verify = (batch + a) / (overhead + seqs * width)
                assert abs(verify - decode) <= 1e-9 * decode, (overhead, batch, width)
    assert needed(4, 4, 500.0) < 0.1 < needed(1, 4, 12.0) < needed(4, 4, 12.0)


def test_rejected_drafts_stop_then_probe_every_probe_interval():
    steps = 6 * (PROBE_EVERY + 1)
    verified = run([[0] * 4] * steps, batch=4)
    assert verified[0], "a new request probes at its first draft"
    stopped = verified.index(False)
    assert stopped <= 4, verified
    later = [s for s in range(stopped, steps) if verified[s]]
    assert len(later) >= 4, verified  # it probes again ...
    gaps = {b - a for a, b in zip(later, later[1:])}
    assert gaps == {PROBE_EVERY + 1}, verified  # ... once per probe interval, not more


def test_accepted_drafts_keep_verifying_every_step():
    for batch in (1, 2, 4, 8):
        assert all(run([[WIDTH - 1] * batch] * 50, batch=batch)), batch


def test_a_request_that_starts_copying_recovers_at_its_next_probe():
    steps = 4 * (PROBE_EVERY + 1)
    turn = 2 * (PROBE_EVERY + 1)
    verified = run([[0 if s < turn else WIDTH - 1] * 4 for s in range(steps)], batch=4)
    assert not all(verified[:turn])
    resumed = verified.index(True, turn)
    assert resumed <= turn + PROBE_EVERY + 1
    assert all(verified[resumed:]), verified


def test_one_good_request_among_poor_ones_does_not_pay_at_batch_4_but_does_alone():
    """Four requests, one whose drafts are mostly right, the others' never: at B = 4 what it
    gains does not pay for the extra rows of four (``needed(4, W)``); alone it does."""
    accepted = math.ceil(needed(4, WIDTH)) - 1
    assert needed(1, WIDTH) < accepted < WIDTH
    good_and_poor = run([[accepted, 0, 0, 0]] * 80, batch=4)
    assert good_and_poor.count(True) <= 4 + 80 / PROBE_EVERY, good_and_poor
    assert all(run([[accepted]] * 80, batch=1))


def test_no_drafts_no_verify_step():
    reqs = [new_req(i) for i in range(3)]
    assert not worth_verifying({r: [] for r in reqs}, 3, WIDTH)


class Adapter:
    """Pages and scratch slots are always free (``CacheAdapter``'s part ``add_drafts`` uses)."""

    P, has_state, trails = 16, False, False

    def ensure_pages(self, req, end) -> bool:
        return True


def decode_plan(reqs) -> StepPlan:
    return StepPlan([WorkItem(r, r.seq_len - 1, r.seq_len) for r in reqs])


def test_add_drafts_gives_full_width_or_nothing():
    """Through ``add_drafts``: a request whose drafts are accepted gets ``width - 1`` tokens
    every step; four whose drafts are rejected soon get none, all of them."""
    good = new_req()
    for _ in range(10):
        plan = decode_plan([good])
        assert add_drafts(plan, Adapter(), lambda r, k: [5] * k, width=WIDTH, context_len=4096) == WIDTH - 1
        assert len(plan.items[0].draft) == WIDTH - 1
        good.spec_verifications += 1
        good.spec_accepted_tokens += WIDTH - 1
    poor = [new_req(i) for i in range(4)]
    added = []
    for _ in range(8):
        plan = decode_plan(poor)
        added.append(add_drafts(plan, Adapter(), lambda r, k: [5] * k, width=WIDTH, context_len=4096))
        for item in plan.items:
            item.req.spec_verifications += bool(item.draft)
        assert len({len(i.draft) for i in plan.items}) == 1  # the step drafts for all or for none
    assert added[0] == 4 * (WIDTH - 1) and added[-1] == 0, added
    always = decode_plan(poor)
    assert add_drafts(always, Adapter(), lambda r, k: [5] * k, width=WIDTH, context_len=4096, gate=None) > 0


traces = st.integers(1, 8).flatmap(
    lambda batch: st.lists(st.lists(st.integers(0, WIDTH - 1), min_size=batch, max_size=batch), max_size=80)
)


@settings(max_examples=60, deadline=None)
@given(traces)
def test_any_trace_probes_within_the_interval_and_averages_what_it_saw(trace):
    """Whatever the acceptance: never more than ``PROBE_EVERY`` steps in a row with drafts
    and no verify step; each request's rate is the average the module docstring defines."""
    if not trace:
        return
    batch = len(trace[0])
    reqs = [new_req(i) for i in range(batch)]
    rates = [draft_policy.PRIOR] * batch
    quiet = 0
    for row in trace:
        verify = worth_verifying({r: [7] * (WIDTH - 1) for r in reqs}, batch, WIDTH)
        quiet = 0 if verify else quiet + 1
        assert quiet <= PROBE_EVERY
        if verify:
            for i, r in enumerate(reqs):
                r.spec_verifications += 1
                r.spec_accepted_tokens += row[i]
                rates[i] += draft_policy.RECENT * (row[i] / (WIDTH - 1) - rates[i])
    worth_verifying({r: [] for r in reqs}, batch, WIDTH)  # takes in the last step's outcome
    for r, rate in zip(reqs, rates):
        assert abs(r.draft_history.rate - rate) < 1e-9


def run_ahead(trace, batch: int, width: int = WIDTH) -> tuple[list[bool], list[bool]]:
    """``run``'s steps as the overlap schedule plans them: a step after one that did not
    verify is planned ahead, without drafts, where ``wont_verify`` (``Engine._can_run_ahead``).
    Returns, per step, whether it verified and whether it was planned ahead."""
    reqs = [new_req(i) for i in range(batch)]
    verified, ahead = [], []
    for step in range(len(trace)):
        if step and not verified[-1] and wont_verify(reqs, width):
            planned_ahead(reqs)
            verified.append(False)
            ahead.append(True)
            continue
        verify = worth_verifying({r: [7] * (width - 1) for r in reqs}, batch, width)
        if verify:
            for i, r in enumerate(reqs):
                r.spec_verifications += 1
                r.spec_accepted_tokens += min(trace[step][i], width - 1)
        verified.append(verify)
        ahead.append(False)
    return verified, ahead


@settings(max_examples=60, deadline=None)
@given(traces)
def test_planning_ahead_changes_no_verify_decision(trace):
    """With full drafts every step, the steps planned ahead are ones that would not have
    verified, and every other step decides as without planning ahead: probes included."""
    if not trace:
        return
    batch = len(trace[0])
    verified, ahead = run_ahead(trace, batch)
    assert verified == run(trace, batch)
    assert not any(a and v for a, v in zip(ahead, verified))


def test_rejected_drafts_are_planned_ahead_between_probes():
    steps = 6 * (PROBE_EVERY + 1)
    trace = [[0] * 4] * steps
    verified, ahead = run_ahead(trace, batch=4)
    assert verified == run(trace, batch=4)
    later = [s for s in range(8, steps) if verified[s]]
    assert len(later) >= 4, verified  # probes, once per interval
    for a, b in zip(later, later[1:]):  # between two probes: the step after the first reads
        assert ahead[a + 2 : b] == [True] * (b - a - 2) and not ahead[a + 1] and not ahead[b], ahead


def test_copying_requests_are_never_planned_ahead():
    for batch in (1, 4):
        verified, ahead = run_ahead([[WIDTH - 1] * batch] * 40, batch)
        assert all(verified) and not any(ahead)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda batch: st.lists(
            st.lists(
                st.tuples(st.integers(0, WIDTH - 1), st.integers(0, WIDTH - 1)),
                min_size=batch,
                max_size=batch,
            ),
            max_size=80,
        )
    )
)
def test_a_step_planned_ahead_would_not_have_verified_its_drafts(trace):
    """Drafts of any length (none included) and any acceptance: where ``wont_verify`` plans a
    step ahead, ``worth_verifying`` on that step's drafts (on a copy of the requests) says
    no; and no request goes more than ``PROBE_EVERY`` steps with a draft, or planned ahead,
    without a verify step."""
    if not trace:
        return
    batch = len(trace[0])
    reqs = [new_req(i) for i in range(batch)]
    quiet = [0] * batch
    verified = True
    ahead = 0
    for row in trace:
        drafts = {r: [7] * n for r, (n, _) in zip(reqs, row)}
        if not verified and wont_verify(reqs, WIDTH):
            twins = copy.deepcopy(reqs)
            assert not worth_verifying({t: drafts[r] for t, r in zip(twins, reqs)}, batch, WIDTH)
            planned_ahead(reqs)
            ahead += 1
            quiet = [q + 1 for q in quiet]
        else:
            verified = worth_verifying(drafts, batch, WIDTH)
            for i, (r, (n, accepted)) in enumerate(zip(reqs, row)):
                if verified and n:
                    r.spec_verifications += 1
                    r.spec_accepted_tokens += min(accepted, n)
                    quiet[i] = 0
                elif n:
                    quiet[i] += 1
        assert max(quiet) <= PROBE_EVERY, quiet


def test_a_new_request_is_not_planned_ahead():
    """Nothing is known of it yet: its first draft probes."""
    old = [new_req(i) for i in range(3)]
    assert not wont_verify(old, WIDTH)
    for r in old:
        r.draft_history = draft_policy.DraftHistory(rate=0.0, idle=1)
    assert wont_verify(old, WIDTH)
    assert not wont_verify([*old, new_req(3)], WIDTH)
    assert old[0].draft_history.idle == 1  # it changes nothing
    planned_ahead(old)
    assert [r.draft_history.idle for r in old] == [2] * 3


def test_a_new_request_that_cannot_draft_next_does_not_stop_the_step_going_ahead():
    """The drafter proves no draft can follow its next token (``may_draft``): it neither
    probes nor gains; one that may draft still probes."""
    old = [new_req(i) for i in range(3)]
    for r in old:
        r.draft_history = draft_policy.DraftHistory(rate=0.0, idle=1)
    fresh = new_req(3)
    assert not wont_verify([*old, fresh], WIDTH, may_draft=lambda r: True)
    assert wont_verify([*old, fresh], WIDTH, may_draft=lambda r: r is not fresh)
    assert fresh.draft_history is None  # it changes nothing
    good = draft_policy.DraftHistory(rate=1.0, idle=0)
    fresh.draft_history = good  # drafts that were all accepted: its gain alone pays at batch 1
    assert not wont_verify([fresh], WIDTH, may_draft=lambda r: True)
    assert wont_verify([fresh], WIDTH, may_draft=lambda r: False)


def test_the_policy_imports_no_jax():
    assert not any(
        isinstance(v, types.ModuleType) and v.__name__.startswith("jax") for v in vars(draft_policy).values()
    )
