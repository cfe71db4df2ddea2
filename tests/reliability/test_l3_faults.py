"""L3 faults on a real engine: a damaged page is a miss (the output equals a recompute and a
counter moves), an unreachable L3 is served around with bounded logging, and L3 is used
again once it recovers."""

from __future__ import annotations

import errno
import logging
import shutil
import time

import pytest

from hicache_jax.storage.faults import flip_bit, restamp, truncate
from hicache_jax.storage.keys import Namespace
from tests.cache.l3_helpers import P, assert_same_as_recompute, prompt, run
from tests.reliability.conftest import faulty, kv_keys, l3_log_lines, set_breakers

BAD = 6  # the damaged page: pages before it may still hit


def _put(llm, key, value):
    llm.engine.storage.client.store.put([(key, value)], force=True)


def _get(llm, key):
    (value,) = llm.engine.storage.client.store.get([key])
    assert value is not None, f"{key} is not in L3"
    return value


def _truncated(llm, keys, other):
    _put(llm, keys[BAD], truncate(_get(llm, keys[BAD])))


def _bit_flip(llm, keys, other):
    _put(llm, keys[BAD], flip_bit(_get(llm, keys[BAD])))


def _swapped(llm, keys, other):
    mine, theirs = _get(llm, keys[BAD]), _get(llm, other[BAD])
    _put(llm, keys[BAD], theirs)
    _put(llm, other[BAD], mine)


def _other_model(llm, keys, other):
    ns = llm.engine.storage.namespace
    foreign = Namespace("another-model", ns.kv_dtype, ns.page_size, ns.layout_version)
    _put(llm, keys[BAD], restamp(_get(llm, keys[BAD]), ns.fingerprint, foreign.fingerprint, keys[BAD]))


def _deleted_after_probe(llm, keys, other):
    faulty(llm).vanish_after_probe(keys[BAD])


FAULTS = {  # fault -> (damage, the counter that must move)
    "truncated": (_truncated, "l3_corrupt_truncated"),
    "bit_flip": (_bit_flip, "l3_corrupt_checksum"),
    "swapped": (_swapped, "l3_corrupt_key"),
    "other_model": (_other_model, "l3_corrupt_namespace"),
    "deleted_after_probe": (_deleted_after_probe, "l3_read_misses"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_damaged_page_is_a_miss_and_is_repaired(make_llm, fault):
    llm = make_llm()
    ids, other_ids = prompt(seed=11), prompt(seed=12)
    first = run(llm, ids)
    run(llm, other_ids)
    assert llm.flush_cache().success
    damage, counter = FAULTS[fault]
    damage(llm, kv_keys(llm, ids), kv_keys(llm, other_ids))
    before = llm.engine.metrics()

    second = run(llm, ids)
    assert_same_as_recompute(second, first)
    stats = llm.engine.metrics()
    assert stats[counter] > before[counter], (counter, stats)
    assert second["meta_info"]["cached_tokens_details"]["storage"] <= BAD * P
    llm.engine.check_integrity()

    # The bad page was forgotten as stored: the second pass's backup rewrote it.
    assert llm.flush_cache().success
    third = run(llm, ids)
    assert_same_as_recompute(third, first)
    assert third["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P


def _wait_for_probe(llm, path):
    time.sleep(llm.engine.storage.client.guard.breakers[path].retry_in() + 0.01)


def test_full_disk_skips_backups_logs_little_and_recovers(make_llm, caplog):
    """ENOSPC on every write: requests are served, backups are dropped (counted), a few log
    lines for many failed pages; once the disk has room again, L3 fills and hits."""
    llm = make_llm()
    set_breakers(llm)
    store = faulty(llm)
    store.fail(lambda: OSError(errno.ENOSPC, "No space left on device"), "put")
    ids = [prompt(seed=s) for s in (21, 22, 23)]
    with caplog.at_level(logging.WARNING):
        refs = [run(llm, x) for x in ids]
        assert llm.flush_cache().success
        for x, ref in zip(ids, refs):
            assert_same_as_recompute(run(llm, x), ref)
    stats = llm.engine.metrics()
    assert stats["l3_write_errors"] >= 1 and stats["l3_writes_dropped_unavailable"] > 0
    assert stats["storage_write_breaker_open"] == 1 and stats["storage_read_breaker_open"] == 0
    failed = stats["l3_write_errors"] + stats["l3_writes_dropped_unavailable"]
    lines = l3_log_lines(caplog)
    assert failed >= 32 and len(lines) <= 6, (failed, lines)

    store.heal()
    _wait_for_probe(llm, "write")
    assert llm.flush_cache().success
    run(llm, ids[0])  # its backup is the probe that closes the breaker
    assert llm.flush_cache().success
    again = run(llm, ids[0])
    assert_same_as_recompute(again, refs[0])
    assert again["meta_info"]["cached_tokens_details"]["storage"] >= len(ids[0]) - P
    assert llm.engine.metrics()["storage_write_breaker_open"] == 0


def test_permission_denied_serves_without_l3_then_uses_it_again(make_llm, caplog):
    llm = make_llm()
    # Open long enough that the requests below find it open on a loaded machine too (at 0.3 s
    # the breaker had let its probe through again before every one of them, once).
    set_breakers(llm, backoff_s=3.0)
    ids = prompt(seed=31)
    ref = run(llm, ids)
    assert llm.flush_cache().success  # ids' pages are in L3 now
    store = faulty(llm)
    store.fail(lambda: PermissionError(errno.EACCES, "Permission denied"))
    with caplog.at_level(logging.WARNING):
        outs = {}
        for seed in (31, 32, 33, 34):
            outs[seed] = run(llm, prompt(seed=seed))
            assert outs[seed]["meta_info"]["cached_tokens_details"]["storage"] == 0
            assert llm.flush_cache().success
    assert_same_as_recompute(outs[31], ref)
    stats = llm.engine.metrics()
    assert stats["storage_read_breaker_open"] == 1 and stats["prefetch_skipped_l3_down"] >= 1
    assert len(l3_log_lines(caplog)) <= 8, l3_log_lines(caplog)

    store.heal()
    _wait_for_probe(llm, "read")
    assert llm.flush_cache().success
    back = run(llm, ids)  # the prefetch's probe closes the read breaker
    assert_same_as_recompute(back, ref)
    assert back["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P
    assert llm.engine.metrics()["storage_read_breaker_open"] == 0


def test_removed_l3_directory_fills_again(make_llm, tmp_path):
    """L3 wiped behind the client's back (another server's eviction, an operator): the
    probe that finds the pages gone makes the next backup write them again."""
    llm = make_llm(tmp_path / "l3")
    ids = prompt(seed=41)
    ref = run(llm, ids)
    assert llm.flush_cache().success
    shutil.rmtree(tmp_path / "l3")
    miss = run(llm, ids)
    assert miss["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert llm.engine.metrics()["l3_stored_forgotten"] > 0
    assert llm.flush_cache().success
    hit = run(llm, ids)
    assert_same_as_recompute(hit, ref)
    assert hit["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P


def test_l3_path_replaced_by_a_file_then_restored(make_llm, tmp_path):
    """A real OS error (ENOTDIR) on every write: served without L3, then L3 is used again."""
    l3 = tmp_path / "l3"
    llm = make_llm(l3)
    set_breakers(llm)
    ids = prompt(seed=51)
    ref = run(llm, ids)
    assert llm.flush_cache().success
    shutil.rmtree(l3)
    l3.write_text("not a directory")
    for seed in (51, 52, 53):
        run(llm, prompt(seed=seed))
        assert llm.flush_cache().success
    stats = llm.engine.metrics()
    assert stats["storage_write_breaker_open"] == 1 and stats["l3_write_errors"] >= 1
    l3.unlink()
    _wait_for_probe(llm, "write")
    run(llm, ids)
    assert llm.flush_cache().success
    hit = run(llm, ids)
    assert_same_as_recompute(hit, ref)
    assert hit["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P
