"""Handover markers on real stores (a TensorStore directory and SeaweedFS's S3): round trip,
hostile values read as missing and are deleted, room keys, and the sweep by age and count
checked against a plain reference over what was published."""

import json
import logging
import pathlib
import re
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.storage import gc
from hicache_jax.storage.capacity import Capacity, CapacityConfig
from hicache_jax.storage.clearing import clear, own_scope, owned_keys
from hicache_jax.storage.handover import HANDOVER, MAX_BYTES, Handover, HandoverBoard, room_key
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.layout import page_path
from hicache_jax.storage.tensorstore_store import TensorStoreL3

T0 = 1_800_000_000.0
FOREIGN = [HANDOVER + "notes.txt", HANDOVER + "007", HANDOVER + "-1", HANDOVER + "12/x"]


def marker(room: int, written: float = T0, **kw) -> Handover:
    fields = dict(status="done", namespace="tiny/page_size=4/nosalt", end=32, input_len=40, server="p0")
    fields.update(kw)
    return Handover(room=room, written=written, **fields)


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path):
    s = TensorStoreL3(str(tmp_path / "l3"))
    yield s
    s.close()


def _keys(store) -> set[str]:
    return set(store.list_keys(HANDOVER))


def test_room_key_and_refusals():
    assert room_key(0) == HANDOVER + "0"
    assert room_key(2**64 - 1) == HANDOVER + str(2**64 - 1)
    for bad in (-1, 2**64, True, False, "12", 1.0, None):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            room_key(bad)


def test_handover_validates_like_decode():
    with pytest.raises(ValueError, match="status"):
        marker(1, status="maybe")
    with pytest.raises(ValueError, match="end"):
        marker(1, end=41)
    with pytest.raises(ValueError, match="failed"):
        marker(1, status="failed", end=8)
    with pytest.raises(ValueError, match="room"):
        marker(2**64)
    with pytest.raises(ValueError, match="input_len"):
        marker(1, input_len=True)
    long = marker(1, status="failed", end=0, message="x" * 5000)
    assert len(long.message) == 1024 and Handover.decode(long.encode()) == long


def _round_trip(store):
    clock = Clock()
    board = HandoverBoard(store, clock=clock)
    rooms = [0, 7, 2**63 + 5, 2**64 - 1]
    sent = {r: marker(r, written=T0 + i) for i, r in enumerate(rooms)}
    sent[7] = marker(7, status="failed", end=0, message="prefill died")
    for h in sent.values():
        board.publish(h)
    assert board.read(12345) is None
    assert {r: board.read(r) for r in rooms} == sent
    retried = marker(7, written=T0 + 50, end=40)
    board.publish(retried)  # a retried room overwrites
    assert board.read(7) == retried
    board.consume(7)
    board.consume(7)  # missing is fine
    assert board.read(7) is None
    assert _keys(store) == {room_key(r) for r in rooms if r != 7}
    for r in rooms:
        board.consume(r)
    assert _keys(store) == set()


def test_round_trip(store):
    _round_trip(store)


HOSTILE = [
    b"",
    b"not json",
    b"\xff\xfe\x00garbage",
    b"[1, 2, 3]",
    b'"a string"',
    b"null",
    b"[" * 4000 + b"]" * 4000,  # deep nesting, under the size bound
    b'{"room": 5}',  # fields missing
    json.dumps({**json.loads(marker(5).encode()), "room": "5"}).encode(),
    json.dumps({**json.loads(marker(5).encode()), "end": 3.5}).encode(),
    json.dumps({**json.loads(marker(5).encode()), "end": -1}).encode(),
    json.dumps({**json.loads(marker(5).encode()), "status": "DONE"}).encode(),
    json.dumps({**json.loads(marker(5).encode()), "written": "yesterday"}).encode(),
    json.dumps({**json.loads(marker(5).encode()), "written": True}).encode(),
    json.dumps({**json.loads(marker(5).encode()), "message": 7}).encode(),
    marker(5).encode().replace(b'"written": 1800000000.0', b'"written": NaN'),
    marker(5).encode().replace(b'"written": 1800000000.0', b'"written": 1e999'),
    marker(5).encode().replace(b'"written": 1800000000.0', b'"written": ' + b"9" * 400),
    marker(5).encode().replace(b'"end": 32', b'"end": ' + b"9" * 5000),
    marker(6).encode(),  # a valid marker of another room
    json.dumps({**json.loads(marker(5).encode()), "pad": "x" * MAX_BYTES}).encode(),  # huge
]


def test_hostile_values_read_as_missing_and_are_deleted(store, caplog):
    board = HandoverBoard(store)
    assert marker(5).encode().count(b'"written": 1800000000.0') == 1  # the replaces above bite
    for value in HOSTILE:
        store.put([(room_key(5), value)], force=True)
        with caplog.at_level(logging.WARNING):
            assert board.read(5) is None, value[:80]
        assert not store.exists([room_key(5)])[0], value[:80]
        if value != marker(6).encode():  # that one decodes; its room is the reader's check
            with pytest.raises(ValueError):
                Handover.decode(value)
    # Bounded: one line for the burst, not one per value.
    assert sum("handover marker" in r.getMessage() for r in caplog.records) <= 2


def test_unknown_fields_are_ignored():
    body = {**json.loads(marker(5).encode()), "future_field": [1, 2]}
    assert Handover.decode(json.dumps(body).encode()) == marker(5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.binary(max_size=200) | st.binary(min_size=MAX_BYTES - 8, max_size=MAX_BYTES + 8))
def test_arbitrary_bytes_never_raise_from_read(store, value):
    board = HandoverBoard(store)
    store.put([(room_key(9), value)], force=True)
    got = board.read(9)
    assert got is None or got.room == 9
    if got is None:
        assert not store.exists([room_key(9)])[0]
    board.consume(9)


_json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    body=st.fixed_dictionaries(
        {},
        optional={
            f: _json_leaf | st.lists(_json_leaf, max_size=2)
            for f in ("room", "status", "namespace", "end", "input_len", "server", "written", "message")
        },
    )
    | st.fixed_dictionaries(
        {
            "room": st.integers(-2, 2**64 + 2),
            "status": st.sampled_from(["done", "failed", "x"]),
            "namespace": st.text(max_size=8),
            "end": st.integers(-2, 50),
            "input_len": st.integers(-2, 50),
            "server": st.text(max_size=8),
            "written": st.floats() | st.integers(),
        }
    )
)
def test_decode_accepts_exactly_valid_markers(body, tmp_path_factory):
    """Any JSON object decodes to a marker that re-encodes to itself, or raises ValueError;
    the reference for "valid" is the constructor's own check on the same fields."""
    data = json.dumps(body).encode()
    try:
        h = Handover.decode(data)
    except ValueError:
        return
    assert Handover.decode(h.encode()) == h
    assert isinstance(h.room, int) and 0 <= h.end <= h.input_len and h.status in ("done", "failed")
    assert h.written == float(body["written"])


def _published(board, spec):
    """Publish markers at the given offsets from T0; returns room -> written."""
    out = {}
    for room, dt in spec:
        board.publish(marker(room, written=T0 + dt))
        out[room] = T0 + dt
    return out


def _sweep_by_age_and_count(store):
    clock = Clock(T0 + 1000)
    for key in FOREIGN:  # not named as room_key names markers: never ours to delete
        store.put([(key, b"someone else's")], force=True)
    board = HandoverBoard(store, max_markers=3, max_age_s=600, clock=clock)
    written = _published(board, [(r, 100 * r) for r in range(1, 10)])  # ages 900..100 s
    store.put([(room_key(42), b"garbage")], force=True)  # unreadable: swept too
    store.put([(room_key(43), marker(44, written=T0 + 999).encode())], force=True)  # wrong room

    def reference(now, max_age, max_markers):
        live = sorted((w, r) for r, w in written.items() if now - w <= max_age)
        return {r for _, r in live[-max_markers:]} if max_markers else set()

    # By age only (the count bound far away): rooms written over 600 s ago go.
    loose = HandoverBoard(store, max_markers=100, max_age_s=600, clock=clock)
    want = reference(clock(), 600, 100)
    assert loose.sweep() == len(written) - len(want) + 2
    assert _keys(store) == {room_key(r) for r in want} | set(FOREIGN)
    # Then by count: of what is left, the 3 newest stay.
    written = {r: w for r, w in written.items() if r in want}
    want = reference(clock(), 600, 3)
    assert board.sweep() == len(written) - 3
    assert _keys(store) == {room_key(r) for r in want} | set(FOREIGN)
    assert {board.read(r).room for r in want} == want
    # Time passes: everything ages out; `now` overrides the clock.
    assert board.sweep(now=T0 + 10_000) == 3 and board.sweep() == 0
    assert _keys(store) == set(FOREIGN)
    for key in FOREIGN:
        assert store.get([key])[0] == b"someone else's"
    store.delete(FOREIGN)


def test_sweep_by_age_and_count(store):
    _sweep_by_age_and_count(store)


def test_sweep_without_listing_is_zero():
    class NoList:
        def list_keys(self, prefix="", end=None):
            raise NotImplementedError

    assert HandoverBoard(NoList()).sweep() == 0


def test_s3_round_trip_and_sweep(weed):
    store = TensorStoreL3(weed.spec_at(f"handover-{time.monotonic_ns()}"))
    _round_trip(store)
    _sweep_by_age_and_count(store)
    store.close()


def _aged(store, now: float, ages: dict[int, float]) -> None:
    """Publish a marker per room, written `ages[room]` seconds before `now`."""
    board = HandoverBoard(store)
    for room, age in ages.items():
        board.publish(marker(room, written=now - age))


def test_evictor_tick_sweeps_markers(store):
    """The lease holder's tick sweeps by age and count; a tick by a server that does not
    hold the lease sweeps nothing."""
    cfg = CapacityConfig(max_bytes=10**9, tick_s=60, lease_ttl_s=600, handover_max_markers=3)
    now = time.time()
    _aged(store, now, {1: 5000, 2: 700, 3: 30, 4: 20, 5: 10, 6: 5})
    store.put([(room_key(7), b"{")] + [(k, b"x") for k in FOREIGN], force=True)
    other = Capacity(lambda: store, cfg, server_id="other", start=False)
    assert other.lease.acquire()
    cap = Capacity(lambda: store, cfg, server_id="evictor", start=False)
    cap.tick()  # not the holder: no sweep
    assert len(_keys(store)) == 7 + len(FOREIGN) and cap.stats()["handover_markers_swept"] == 0
    other.lease.release()
    cap.tick()
    assert _keys(store) == {room_key(r) for r in (4, 5, 6)} | set(FOREIGN)
    assert cap.stats()["handover_markers_swept"] == 4  # 2 by age, 1 unreadable, 1 by count
    # Later ticks read only new markers; a room re-published since is read again before
    # it is deleted, so its newer `written` counts.
    _aged(store, now, {4: 0, 8: 1, 9: 2})  # 4 again, the newest now: 5 and 6 go by count
    cap.tick()
    assert _keys(store) == {room_key(r) for r in (4, 8, 9)} | set(FOREIGN)
    assert cap.stats()["handover_markers_swept"] == 6
    cap.close()
    other.close(final_tick=False)


def test_evictor_tick_stays_cheap_with_10k_markers(store):
    """10,000 live markers: the first tick reads them all; later ticks list once and read
    none, so they cost about one listing."""
    now = time.time()
    body = marker(0, written=now).encode()
    root = pathlib.Path(store.spec["path"], HANDOVER)  # written as files: faster than 10k puts
    root.mkdir(parents=True)
    for r in range(10_000):
        (root / str(r)).write_bytes(body.replace(b'"room": 0', b'"room": %d' % r))
    cap = Capacity(lambda: store, CapacityConfig(max_bytes=10**9, tick_s=60, lease_ttl_s=600), start=False)
    t0 = time.perf_counter()
    cap.tick()
    first = time.perf_counter() - t0
    reads = store.stats()["pages_read"]
    t0 = time.perf_counter()
    cap.tick()
    later = time.perf_counter() - t0
    t0 = time.perf_counter()
    listing = len(store.list_keys(HANDOVER))
    list_s = time.perf_counter() - t0
    assert listing == 10_000 and cap.stats()["handover_markers_swept"] == 0
    assert store.stats()["pages_read"] == reads  # no marker read again
    print(f"10k markers: first tick {first:.3f} s, later tick {later:.3f} s, one listing {list_s:.3f} s")
    assert later < max(0.5, 5 * list_s), (first, later, list_s)
    cap.close()


def test_gc_reports_and_sweeps_markers(store):
    now = time.time()
    _aged(store, now, {1: 3 * 3600, 2: 1800, 3: 60, 4: 5})
    store.put([(room_key(5), b"[]")] + [(k, b"x") for k in FOREIGN], force=True)
    c = gc.Collector(store, quiet=True)
    report = c.report()["handover"]
    assert report["markers"] == 5 and report["unreadable"] == 1
    assert abs(report["oldest_age_s"] - 3 * 3600) < 60
    assert c.sweep_markers(None, dry_run=True) == {"markers": 3, "dry_run": True}  # > 600 s, unreadable
    assert len(_keys(store)) == 5 + len(FOREIGN)
    assert c.sweep_markers(30.0, dry_run=False) == {"markers": 4, "dry_run": False}  # --older_than=30s
    assert _keys(store) == {room_key(4)} | set(FOREIGN)
    c.close()
    # The CLI: the report's table and JSON, and --older_than reaching markers too.
    _aged(store, now, {6: 7200})
    spec = store.spec["path"] if store.spec.get("driver") == "file" else None
    assert spec is not None
    cli = [sys.executable, "-m", "hicache_jax.storage.gc", f"--spec={spec}", "--lease_wait_s=5", "--json"]
    out = json.loads(
        subprocess.run([*cli, "--older_than=1h"], capture_output=True, text=True, check=True).stdout
    )
    assert out["handover_sweep"] == {"markers": 1, "dry_run": False}
    assert out["report"]["handover"]["markers"] == 1 and _keys(store) == {room_key(4)} | set(FOREIGN)
    _aged(store, now, {6: 7200})
    c = gc.Collector(store, quiet=True)
    table = gc._table(c.report())
    c.close()
    assert re.search(r"handover markers: 2 \(0 unreadable, oldest 720\d s old\)", table), table


def test_clear_all_removes_markers_and_a_namespace_clear_leaves_them(store):
    _aged(store, time.time(), {1: 1, 2: 2})
    ns = Namespace("tiny", "float32", 4, 1)
    page = page_path(ns, bytes(32), "kv")
    store.put([(page, b"page")] + [(k, b"x") for k in FOREIGN], force=True)
    assert set(owned_keys(store, own_scope(ns))) == {page}
    assert clear(store, own_scope(ns)) == 1 and len(_keys(store)) == 2 + len(FOREIGN)
    assert {room_key(1), room_key(2)} <= set(owned_keys(store))
    assert clear(store) == 2
    assert _keys(store) == set(FOREIGN)  # foreign files under meta/handover/ stay
