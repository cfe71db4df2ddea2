"""The prefill/decode handover's two halves, in process (server/disaggregation.py): the end a
prefill server publishes is what a fresh decode server then serves from L3, and a decode
server's wait ends in a handover only for a marker that is done, of its namespace and of its
room. The servers behind sglang-router are tests/server/test_pd.py's."""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.sampling_params import InvalidRequest
from hicache_jax.server.disaggregation import Disaggregation
from hicache_jax.server.rooms import rooms_for
from hicache_jax.storage.handover import Handover, room_key
from hicache_jax.storage.layout import namespace_dir
from tests.cache.l3_helpers import P, hicache_llm, prompt, run


@pytest.mark.parametrize(
    ("value", "prompts", "words"),
    [
        (-1, 1, r"bootstrap_room must be an integer in \[0, 2\*\*64\), got -1"),
        (2**64, 1, r"bootstrap_room must be an integer"),
        ([1, True], 2, r"bootstrap_room\[1\] must be an integer"),
        ([1], 2, r"bootstrap_room: 1 rooms for 2 prompt"),
        (5, 2, r"a batch of 2 prompts needs a list of rooms"),
    ],
)
def test_rooms_are_checked_per_prompt(value, prompts, words):
    with pytest.raises(InvalidRequest, match=words):
        rooms_for(value, prompts)


def test_rooms_for_good_values():
    assert rooms_for(None, 3) == [None] * 3
    assert rooms_for(2**64 - 1, 1) == [2**64 - 1]
    assert rooms_for([0, 9], 2) == [0, 9]


def _page_files(l3_dir) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(l3_dir / "pages") for f in fs]


@pytest.mark.parametrize("preset", ["tiny-swa", "tiny-mamba"])
def test_the_published_end_is_what_a_fresh_server_serves(tmp_path, preset):
    """The prefill side's ``durable_end`` over L3 equals the storage hit a decode server with
    nothing of the prompt in L1/L2 gets, with every page there and after losing some: the
    marker never promises what the match will refuse (sliding window, recurrent snapshots)."""
    l3 = tmp_path / "l3"
    kw = dict(preset=preset, hicache_prefetch_threshold=0)
    prefill, decode = hicache_llm(l3, **kw), hicache_llm(l3, **kw)
    tier = prefill.engine.storage

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        seed=st.integers(0, 10**6),
        pages=st.integers(2, 9),
        extra=st.integers(0, P - 1),
        drop=st.integers(0, 40),
    )
    def check(seed, pages, extra, drop):
        ids = prompt(seed=seed, pages=pages)[: pages * P - P + 1 + extra]  # ends anywhere in a page
        before = set(_page_files(l3))
        run(prefill, ids)
        assert tier.client.flush(30)  # the write-through queue, drained
        written = sorted(set(_page_files(l3)) - before)
        end, target = tier.durable_end(ids, len(ids), None)
        assert target == (len(ids) - 1) // P * P
        assert end == target  # recurrent too: a snapshot is taken at the prompt's last page boundary
        if drop and written:  # a page lost from L3 (evicted, or never written)
            os.remove(written[drop % len(written)])
            end, _ = tier.durable_end(ids, len(ids), None)
        out = run(decode, ids)
        assert out["meta_info"]["cached_tokens_details"]["storage"] == end, (end, out["meta_info"])
        assert out["output_ids"] == run(prefill, ids, cache_salt="recompute")["output_ids"]
        assert decode.flush_cache().success  # the next example starts with empty L1/L2 again

    check()


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    llm = hicache_llm(tmp_path_factory.mktemp("pd") / "l3", preset="tiny")
    return llm.engine.storage


def _decode(tier, wait_s: float = 0.3) -> Disaggregation:
    return Disaggregation("decode", wait_s, tier, check=lambda **_: None)


def _marker(tier, room: int, **kw) -> Handover:
    base = dict(
        room=room,
        status="done",
        namespace=namespace_dir(tier.ns(None)),
        end=3 * P,
        input_len=4 * P,
        server="prefill-1",
        written=time.time(),
    )
    return Handover(**(base | kw))


def test_a_done_marker_of_this_namespace_hands_over_and_is_consumed(tier):
    pd = _decode(tier)
    pd.board.publish(_marker(tier, 11))
    got = asyncio.run(pd._await_one(11, None))
    assert got["status"] == "handover" and got["end"] == 3 * P and got["wait_s"] < 0.3, got
    assert pd.board.read(11) is None, "the decode server deletes the marker it used"
    assert pd.counters["pd_handovers"] == 1 and pd.counters["pd_fallbacks"] == 0


@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        (None, r"no handover marker within 0.3 s"),
        ({"status": "failed", "end": 0, "message": "L3 down"}, r"could not hand it over: L3 down"),
        (
            {"namespace": "other-model/fields/nosalt"},
            r"writes namespace other-model/fields/nosalt, this server reads",
        ),
        (b"{not json", r"no handover marker within"),  # a hostile value reads as missing
        ("another room", r"no handover marker within"),  # another room's marker under this key
    ],
)
def test_everything_else_falls_back_and_says_why(tier, marker, reason):
    pd = _decode(tier)
    room = 12
    store = pd.board.store
    if isinstance(marker, dict):
        pd.board.publish(_marker(tier, room, **marker))
    elif isinstance(marker, bytes):
        store.put([(room_key(room), marker)], force=True)
    elif marker is not None:
        store.put([(room_key(room), _marker(tier, room + 1).encode())], force=True)
    t0 = time.monotonic()
    got = asyncio.run(pd._await_one(room, None))
    assert got["status"] == "fallback", got
    assert re.search(reason, got["reason"]), got
    if not isinstance(marker, dict):
        assert time.monotonic() - t0 >= 0.3  # waited out the deadline
    assert pd.counters["pd_fallbacks"] == 1 and pd.counters["pd_handovers"] == 0
    assert pd.board.read(room) is None


def test_a_prefill_server_sweeps_markers_no_decode_server_took(tier):
    """Without a capped L3 no evictor runs: the prefill server itself bounds the markers."""
    pd = Disaggregation("prefill", 1.0, tier)
    stale = _marker(tier, 21, written=time.time() - 2 * pd.board.max_age_s)
    pd.board.publish(stale)
    fresh = {"input_ids": prompt(seed=3, pages=2)}
    asyncio.run(pd._publish(22, fresh, 16, "done"))
    assert pd.board.read(21) is None and pd.board.read(22) is not None
    assert pd.counters["pd_markers_swept"] == 1 and pd.counters["pd_markers_published"] == 1
    asyncio.run(pd._publish(23, fresh, 16, "done"))  # within SWEEP_EVERY_S: no second listing
    assert pd.counters["pd_markers_swept"] == 1
