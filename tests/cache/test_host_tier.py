"""L2 (host memory): load-back after L1 eviction, L2 eviction, and the two-pass test under
every prefetch policy and write policy."""

import pytest

from tests.cache.l3_helpers import (
    P,
    ReadGate,
    assert_same_as_recompute,
    hicache_llm,
    prompt,
    run,
    two_pass,
)

PAGE_BYTES = 2 * 2 * P * 2 * 16 * 4  # tiny preset: 2 layers x (k, v) x 16 tokens x 2 heads x 16 x f32


# Layer by layer: 0 loads every page before the step; 4 takes four pages of each group
# into the step (the rest before it); 64 takes them all.
@pytest.mark.parametrize("layerwise", [0, 4, 64])
def test_l1_eviction_loads_back_from_l2(tmp_path, layerwise):
    # 20 device pages: a second 16-page prompt evicts most of the first from L1.
    llm = hicache_llm(
        tmp_path / "l3", preset="tiny", max_total_tokens=20 * P, hicache_layerwise_pages=layerwise
    )
    a, b = prompt(1), prompt(2)
    first = run(llm, a)
    run(llm, b)
    again = run(llm, a)
    meta = again["meta_info"]
    assert meta["cached_tokens"] == len(a) - P
    assert meta["cached_tokens_details"]["host"] > 0, meta
    loads = llm.engine.metrics()
    assert loads["host_loads"] > 0
    took, groups = loads["host_loads_layerwise"], 2  # the tiny preset: full and sliding pages
    assert took == (loads["host_loads"] if layerwise >= 16 else took), loads  # 64: the step took all
    assert (0 < took <= groups * layerwise) if layerwise else took == 0, loads
    assert_same_as_recompute(again, first)
    llm.engine.check_integrity()


def test_tiny_l2_evicts_and_l3_still_serves(tmp_path):
    # L2 holds 20 pages per kind: three 16-page prompts force L2 evictions.
    llm = hicache_llm(tmp_path / "l3", preset="tiny", hicache_size_gb=20 * 2 * PAGE_BYTES / 1e9)
    assert llm.engine.prefix_cache.host["full"].size == 20
    a = prompt(1)
    first = run(llm, a)
    run(llm, prompt(2))
    run(llm, prompt(3))
    stats = llm.engine.metrics()
    assert stats["l3_writes"] > 20, "every backup reached L3 although L2 could not keep them"
    assert llm.flush_cache().success
    again = run(llm, a)
    assert again["meta_info"]["cached_tokens_details"]["storage"] >= len(a) - P
    assert_same_as_recompute(again, first)
    llm.engine.check_integrity()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_two_pass_under_each_prefetch_policy(tmp_path, monkeypatch, policy):
    llm = hicache_llm(
        tmp_path / "l3", preset="tiny", hicache_storage_prefetch_policy=policy, max_running_requests=1
    )
    ids = prompt(4)
    first = run(llm, ids)
    assert llm.flush_cache().success
    if policy == "best_effort":
        gate = ReadGate(llm.engine, monkeypatch)
        try:
            second = _best_effort_second_pass(llm, ids, gate)
        finally:
            gate.open()  # never leave a reader blocked behind a failed assertion
    else:
        second = run(llm, ids)
    assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P
    assert_same_as_recompute(second, first)
    assert not llm.engine.scheduler.prefetch._timings  # every request done: no read timing kept


def _best_effort_second_pass(llm, ids, gate):
    """best_effort never holds a request for its prefetch, and uses what landed before the
    request is scheduled. The L3 reads are held by a gate, so both are deterministic."""
    engine = llm.engine
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    # 1. The slot is free: the request runs at once, its reads still held (no storage hit).
    revoked = engine.metrics()["prefetch_revoked"]
    rid = engine.add_request(input_ids=ids, sampling_params=greedy, return_logprob=True)
    engine.step()
    assert [r.rid for r in engine.scheduler.running] == [rid] and engine.scheduler.prefetch.reading()
    assert engine.metrics()["prefetch_revoked"] == revoked + 1
    gate.release()
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output(rid)["meta_info"]["cached_tokens_details"]["storage"] == 0
    # Its read landed after its admission: no TTFT timing is kept for it (nobody would take it).
    assert not engine.scheduler.prefetch._timings
    assert llm.flush_cache().success
    # 2. Queued behind a running request (one slot): its reads land while it waits, and it
    #    starts from them.
    gate.close()
    blocker = engine.add_request(input_ids=prompt(9, pages=2), sampling_params={"max_new_tokens": 4})
    rid = engine.add_request(input_ids=ids, sampling_params=greedy, return_logprob=True)
    engine.step()
    assert [r.rid for r in engine.scheduler.running] == [blocker] and engine.scheduler.prefetch.reading()
    gate.release()
    while engine.has_unfinished():
        engine.step()
    engine.pop_output(blocker)
    return engine.pop_output(rid)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_two_pass_under_each_write_policy(tmp_path, policy):
    llm = hicache_llm(tmp_path / "l3", preset="tiny", hicache_write_policy=policy)
    ids = prompt(6)
    if policy == "write_through_selective":
        for _ in range(2):  # backed up once a node has been hit twice
            run(llm, ids)
        assert llm.engine.metrics()["host_backups"] == 0
        run(llm, ids)
        assert llm.engine.metrics()["host_backups"] > 0
        llm.flush_cache()
    if policy == "write_back":
        run(llm, ids)
        assert llm.engine.metrics()["host_backups"] == 0, "write_back copies only on eviction or flush"
        llm.flush_cache()
    _, second = two_pass(llm, ids) if policy == "write_through" else (None, run(llm, ids))
    assert second["meta_info"]["cached_tokens"] >= len(ids) - P
    assert second["meta_info"]["cached_tokens_details"]["storage"] > 0
