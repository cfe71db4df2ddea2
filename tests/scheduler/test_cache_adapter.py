"""CacheAdapter: match -> lock -> insert as chunks complete -> insert on finish -> unlock,
every page owned exactly once (counted from the requests: ``Sim.check_ownership``), and
all-or-nothing allocation."""

from __future__ import annotations

from hicache_jax.cache.radix import path_to
from hicache_jax.request import Req
from hicache_jax.sampling_params import SamplingParams
from tests.scheduler.sim import Setup, Sim

PROMPT = list(range(3, 3 + 22))  # 22 tokens: 5 full pages of 4, the last token recomputed


def request(rid, ids=PROMPT):
    return Req(rid=rid, input_ids=list(ids), sampling=SamplingParams(max_new_tokens=2, ignore_eos=True))


def admit(sim, req, end):
    match = sim.adapter.match(req)
    assert sim.adapter.admit(req, match, end)
    sim.sched.running.append(req)  # as the scheduler does, so the ownership check counts it
    return match


def test_lifecycle_match_lock_insert_unlock():
    sim = Sim(Setup())
    ad, cache = sim.adapter, sim.cache
    a = request("a")
    match = admit(sim, a, 8)
    assert match.end == 0 and a.cache.own["full"] == [True, True] and a.cache.last_node is None
    sim.check_ownership()
    a.num_computed = 8
    ad.after_step(a, insert=True)  # a chunk boundary: its two pages go to the tree
    assert a.cache.own["full"] == [False, False] and a.cache.num_inserted_pages == 2
    assert [n.dev["full"] for n in path_to(a.cache.last_node)] == a.cache.pages[
        "full"
    ] and a.cache.last_node.lock_ref == 1
    sim.check_ownership()
    assert ad.ensure_pages(a, 22)
    a.num_computed = 22
    sim.check_ownership()
    sim.sched.running.remove(a)
    ad.finish(a)  # the computed sequence goes to the tree, the rest is freed, locks dropped
    sim.finished.append(a)
    sim.check_ownership()
    assert sum(1 for _ in cache.nodes()) == 22 // 4 and cache.pools["full"].num_used == 5

    b = request("b")
    match = admit(sim, b, 22)
    assert match.end == 20, "the whole cached prompt but its last token"
    assert b.cache.pages["full"][:5] == [n.dev["full"] for n in match.nodes] and not any(
        b.cache.own["full"][:5]
    )
    assert b.cache.own["full"][5:] == [True] and all(n.lock_ref == 1 for n in match.nodes)
    assert cache.evict("full", 100) == 0, "a running request's prefix was evicted"
    sim.check_ownership()
    sim.sched.running.remove(b)
    ad.release(b)
    sim.aborted.append(b)
    sim.check_ownership()  # no lock left
    assert cache.evict("full", 100) == 5 and cache.pools["full"].num_used == 0


def test_allocation_is_all_or_nothing():
    # The sliding pool is the short one: a failed allocation must hand back the full pages.
    sim = Sim(Setup(full_pages=16, window=4, swa_pages=3))
    r = request("r")
    full_before = sim.cache.pools["full"].num_used
    match = sim.adapter.match(r)
    assert not sim.adapter.admit(r, match, 22)  # 6 pages of each kind; only 3 sliding
    assert sim.cache.pools["full"].num_used == full_before and sim.cache.pools["swa"].num_used == 0
    assert not r.cache.pages.get("full") and r.cache.last_node is None
    sim.aborted.append(r)
    sim.check_ownership()


def test_sliding_pages_out_of_the_window_are_freed_while_running():
    sim = Sim(Setup(full_pages=16, window=4, swa_pages=16))
    r = request("r")
    admit(sim, r, 22)
    r.num_computed = 22
    sim.adapter.after_step(r, insert=True)
    window = set(sim.cache.rules.window_pages(20))
    own_swa = [
        j for j, (p, o) in enumerate(zip(r.cache.pages["swa"], r.cache.own["swa"])) if p is not None and o
    ]
    kept = [j for j, p in enumerate(r.cache.pages["swa"]) if p is not None]
    assert set(kept) >= window and set(kept) <= window | {5}, (kept, window)
    assert own_swa == [5], "its inserted pages belong to the tree, the partial last page to it"
    sim.check_ownership()


def test_cached_tokens_name_the_tier_a_page_came_from_across_a_refused_admission():
    # 8 device pages: the prompt's 5 cached pages come back from L2, then its 6th page
    # cannot be had (3 held here): the admission is refused with the 5 loaded. The next
    # admission finds them on the device, yet they were L2 hits for this request.
    sim = Sim(Setup(full_pages=8, host_pages=16))
    a = sim.add("a", PROMPT, 1)
    while sim.sched.has_work():
        sim.step()
    assert sim.cache.evict("full", 100) == 5  # now on the host only
    held = sim.cache.alloc("full", 3)
    b = request("b")
    match = sim.adapter.match(b)
    assert match.page_tiers == ["host"] * 5
    assert not sim.adapter.admit(b, match, 22)
    assert all("full" in n.dev for n in match.nodes), "the refused admission loaded them"
    sim.cache.pools["full"].free(held)
    match = admit(sim, b, 22)
    assert match.page_tiers == ["device"] * 5
    assert b.cached_tokens == 20 and b.cached_details == {"device": 0, "host": 20, "storage": 0}
    assert a.cached_tokens == 0
    sim.check_ownership()
