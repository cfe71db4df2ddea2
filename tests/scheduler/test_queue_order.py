"""``schedule_policy``: ``fcfs`` admits in arrival order, ``lpm`` the longest cached prefix
first; and lpm's age bound: a request without a prefix is admitted within
``LPM_AGE_STEPS`` rounds however many requests with cached prefixes keep arriving."""

from __future__ import annotations

import dataclasses

from hicache_jax.scheduler.scheduler import LPM_AGE_STEPS
from tests.scheduler.sim import Setup, Sim

P = 4
SYSTEM = list(range(100, 100 + 8 * P))  # a cached system prompt of 8 pages


def sim_with(policy: str) -> Sim:
    sim = Sim(Setup(page_size=P, chunk=16, max_running=1, full_pages=128, max_pages=32))
    sim.cfg = dataclasses.replace(sim.cfg, schedule_policy=policy)
    sim.sched.cfg = sim.cfg
    warm = sim.add("warm", SYSTEM + [1], 1)  # puts the system prompt in the tree
    while sim.sched.has_work():
        sim.step()
    assert warm.output_ids
    return sim


def admission_order(sim: Sim) -> list[str]:
    order = []

    def record(plan):
        for item in plan.items if plan else []:
            if item.req.rid not in order:
                order.append(item.req.rid)

    while sim.sched.has_work():
        sim.step(record)
        sim.check_ownership()
    return order


def test_lpm_takes_the_longest_cached_prefix_first_and_fcfs_arrival_order():
    prompts = {
        "none": [7] * 20,
        "two": SYSTEM[: 2 * P] + [8] * 20,
        "all": SYSTEM + [9] * 20,
        "four": SYSTEM[: 4 * P] + [10] * 20,
    }
    for policy, want in (("fcfs", ["none", "two", "all", "four"]), ("lpm", ["all", "four", "two", "none"])):
        sim = sim_with(policy)
        for rid, prompt in prompts.items():
            sim.add(rid, prompt, 2)
        assert admission_order(sim) == want, policy


def test_lpm_age_bound_admits_a_request_without_a_prefix():
    sim = sim_with("lpm")
    lonely = sim.add("lonely", [7] * 10, 1)
    admitted_at = None
    for k in range(4 * LPM_AGE_STEPS):
        sim.add(f"hit{k}", SYSTEM + [11, k], 1)  # a request a round, each hitting the system prompt
        sim.step()
        if lonely.output_ids and admitted_at is None:
            admitted_at = k
    assert admitted_at is not None, "starved"
    assert LPM_AGE_STEPS - 1 <= admitted_at <= LPM_AGE_STEPS + 4, admitted_at  # not before: lpm ordered
