"""Prefill -> decode handover markers: a small record per request, beside the pages in L3.

    meta/handover/<room>     {"room": ..., "status": "done"|"failed", "end": ..., ...}

sglang-router's PD mode sends one request to a prefill and a decode server with the same
``bootstrap_room`` (a random u64). The prefill server, once the prompt's pages are durable in
L3, publishes a `Handover` under `room_key(room)`; the decode server polls `read` until a
deadline, loads the pages as an ordinary L3 hit (or computes the prompt itself when none comes
or it says failed), then `consume`s it.

A marker is a hint, never trusted for data: the pages it points at are checksummed (and
HMAC'd with a page-auth key), so a forged or stale marker can at most make a decode server
stop waiting early. Reading is defensive: a value that is not a marker of this room (bad JSON,
wrong types, another room, oversized) reads as missing, is logged at a bounded rate and is
deleted. Markers a decode server never consumed (it died, or fell back before the marker came)
are swept by age and count: by the fleet evictor each tick (capacity.py) and by the offline
gc (gc.py).

    writer (prefill)            store                         reader (decode)
    pages durable ------> publish(meta/handover/R) --> read(R) polls until deadline
                                                     --> L3 hit of the pages, consume(R)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Callable

from hicache_jax.storage.layout import META
from hicache_jax.storage.ratelog import RateLimitedLog

HANDOVER = META + "handover/"
STATUSES = ("done", "failed")
MAX_BYTES = 8192  # a marker is ~300 B; anything larger is not one (never parsed)
MAX_MESSAGE = 1024  # a failed marker's message is cut to this many characters
ROOM_LIMIT = 1 << 64
DELETE_BATCH = 256
READ_BATCH = 1024
# The names `room_key` gives: decimal, no sign, no leading zeros (so one name per room).
_NAME = re.compile(r"^" + re.escape(HANDOVER) + r"(0|[1-9][0-9]{0,19})$")

log = logging.getLogger(__name__)
_ratelog = RateLimitedLog(log)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_room(room: object) -> int:
    """`room` if it is a bootstrap room (an int in [0, 2**64)); ValueError naming it otherwise."""
    if not _is_int(room) or not 0 <= room < ROOM_LIMIT:
        raise ValueError(f"bootstrap_room must be an integer in [0, 2**64), got {room!r}")
    return room


def room_key(room: int) -> str:
    """The store key of the marker of `room`: ``meta/handover/<decimal room>``."""
    return f"{HANDOVER}{check_room(room)}"


def room_of(key: str) -> int | None:
    """Inverse of `room_key`; None for a key it cannot produce (not ours: never deleted)."""
    m = _NAME.match(key)
    if m is None:
        return None
    room = int(m.group(1))
    return room if room < ROOM_LIMIT else None


# field -> (accepted types, a description for the error)
_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "room": (_is_int, "an integer"),
    "status": (lambda x: isinstance(x, str), "a string"),
    "namespace": (lambda x: isinstance(x, str), "a string"),
    "end": (_is_int, "an integer"),
    "input_len": (_is_int, "an integer"),
    "server": (lambda x: isinstance(x, str), "a string"),
    "written": (lambda x: _is_int(x) or isinstance(x, float), "a number"),
    "message": (lambda x: isinstance(x, str), "a string"),
}


@dataclasses.dataclass(frozen=True)
class Handover:
    """What a prefill server says about one request's prompt. Validated on construction, so
    `decode` and the writer refuse the same things."""

    room: int
    status: str  # "done" | "failed"
    namespace: str  # the writer's namespace dir (layout.namespace_dir)
    end: int  # prompt tokens whose pages are durable in L3 (the usable prefix end); 0 if failed
    input_len: int
    server: str  # the writer's server id
    written: float  # Unix time
    message: str = ""  # why, for failed

    def __post_init__(self) -> None:
        for name, (ok, what) in _FIELDS.items():
            if not ok(getattr(self, name)):
                raise ValueError(f"Handover.{name} must be {what}, got {getattr(self, name)!r}")
        check_room(self.room)
        if self.status not in STATUSES:
            raise ValueError(f"Handover.status must be one of {STATUSES}, got {self.status!r}")
        if not 0 <= self.end <= self.input_len:
            raise ValueError(f"Handover.end must be in [0, input_len={self.input_len}], got {self.end}")
        if self.status == "failed" and self.end:
            raise ValueError(f"a failed Handover has end 0, got {self.end}")
        try:
            written = float(self.written)
        except OverflowError:
            written = math.inf
        if not math.isfinite(written):
            raise ValueError(f"Handover.written must be a finite time, got {self.written!r}")
        object.__setattr__(self, "written", written)
        if len(self.message) > MAX_MESSAGE:
            object.__setattr__(self, "message", self.message[:MAX_MESSAGE])

    def encode(self) -> bytes:
        data = json.dumps(dataclasses.asdict(self), allow_nan=False, sort_keys=True).encode()
        if len(data) > MAX_BYTES:
            raise ValueError(f"Handover of room {self.room} encodes to {len(data)} B, over {MAX_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> Handover:
        """The marker in `data`; ValueError naming what is wrong with anything else. Whether
        its room is the one asked for is the caller's check."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"a handover marker is bytes, got {type(data).__name__}")
        if len(data) > MAX_BYTES:
            raise ValueError(f"handover marker of {len(data)} B, over {MAX_BYTES}")
        try:
            body = json.loads(bytes(data))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"handover marker is not JSON: {type(e).__name__}: {e}") from None
        if not isinstance(body, dict):
            raise ValueError(f"handover marker is a JSON {type(body).__name__}, not an object")
        required = [f for f in _FIELDS if f != "message"]
        missing = [f for f in required if f not in body]
        if missing:
            raise ValueError(f"handover marker lacks {missing}")
        # Fields beyond ours are ignored: a newer writer may add some.
        return cls(**{f: body[f] for f in _FIELDS if f in body})


class HandoverBoard:
    """Markers on one store. Thread-safe: it holds no mutable state of its own (the store is
    the only state). Store errors propagate to the caller (a decode server treats them as
    "no marker yet"); a malformed value never raises.

    Bounds, applied by `sweep`: a marker older than `max_age_s` (by its `written`) is
    deleted, and of the rest only the `max_markers` newest are kept."""

    def __init__(self, store, *, max_markers: int = 10_000, max_age_s: float = 600.0, clock=time.time):
        if max_markers < 0:
            raise ValueError(f"HandoverBoard.max_markers must be >= 0, got {max_markers}")
        if not max_age_s >= 0:
            raise ValueError(f"HandoverBoard.max_age_s must be >= 0, got {max_age_s}")
        self.store = store
        self.max_markers = max_markers
        self.max_age_s = max_age_s
        self._clock = clock

    def publish(self, h: Handover) -> None:
        """Write (or overwrite: a retried room's newer marker wins) the marker of `h.room`."""
        self.store.put([(room_key(h.room), h.encode())], force=True)

    def read(self, room: int) -> Handover | None:
        """The marker of `room`, or None: missing, or not a valid marker of this room (that
        one is deleted, and logged at a bounded rate)."""
        key = room_key(room)
        (value,) = self.store.get([key])
        if value is None:
            return None
        try:
            h = Handover.decode(value)
            if h.room != room:
                raise ValueError(f"it names room {h.room}")
            return h
        except ValueError as e:
            _ratelog.warning("bad", "L3: dropping unreadable handover marker %s: %s", key, e)
        try:
            self._drop([key])
        except Exception as e:  # noqa: BLE001 - a hint we could not delete; the sweep will
            _ratelog.warning("drop", "L3: could not delete handover marker %s: %s", key, e)
        return None

    def consume(self, room: int) -> None:
        """Delete the marker of `room` (missing is fine)."""
        self.store.delete([room_key(room)])

    def scan(self, known: dict[str, float] | None = None) -> dict[str, float | None]:
        """Every marker key in the store (one listing) -> its `written`, or None where the
        value is unreadable or names another room. Keys that vanish meanwhile are left out;
        keys not named as `room_key` names them are not ours and never listed. Keys in
        `known` (key -> written, as an earlier scan read them) are not read again. {} for a
        store that cannot list."""
        try:
            keys = [k for k in self.store.list_keys(HANDOVER) if room_of(k) is not None]
        except NotImplementedError:
            return {}
        known = known or {}
        out = {k: known[k] for k in keys if k in known}
        out.update(self._written([k for k in keys if k not in known]))
        return out

    def expired(self, scanned: dict[str, float | None], now: float | None = None) -> list[str]:
        """The keys of `scanned` that `sweep` deletes: unreadable ones, those written over
        `max_age_s` before `now`, and, beyond `max_markers`, the oldest of the rest."""
        cutoff = (self._clock() if now is None else now) - self.max_age_s
        gone = [k for k, w in scanned.items() if w is None or w < cutoff]
        live = sorted((w, k) for k, w in scanned.items() if w is not None and w >= cutoff)
        return gone + [k for _, k in live[: max(0, len(live) - self.max_markers)]]

    def sweep(self, now: float | None = None, *, known: dict[str, float] | None = None) -> int:
        """Delete `expired` markers; returns how many (0 for a store that cannot list). One
        listing, reads in batches of `READ_BATCH`, deletes in batches of `DELETE_BATCH`.

        `known`: a cache the caller owns (and does not share between threads), key ->
        written, filled and pruned here, so that a periodic sweep reads only markers new
        since the last. A marker the cache condemns is read again before it is deleted (a
        retried room's overwrite is newer than the cache says)."""
        now = self._clock() if now is None else now
        scanned = self.scan(known)
        stale = {k for k in scanned if known and k in known}  # not read by this sweep
        gone = self.expired(scanned, now)
        while recheck := [k for k in gone if k in stale]:  # each key is read again once at most
            stale.difference_update(recheck)
            fresh = self._written(recheck)
            for k in recheck:
                if k in fresh:
                    scanned[k] = fresh[k]
                else:
                    del scanned[k]  # consumed since the listing
            gone = self.expired(scanned, now)
        self._drop(gone)
        if known is not None:
            known.clear()
            dropped = set(gone)
            known.update((k, w) for k, w in scanned.items() if w is not None and k not in dropped)
        return len(gone)

    def _written(self, keys: list[str]) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for i in range(0, len(keys), READ_BATCH):
            batch = keys[i : i + READ_BATCH]
            for key, value in zip(batch, self.store.get(batch)):
                if value is None:
                    continue  # consumed since the listing
                try:
                    h = Handover.decode(value)
                except ValueError:
                    h = None
                out[key] = h.written if h is not None and h.room == room_of(key) else None
        return out

    def _drop(self, keys: list[str]) -> None:
        for i in range(0, len(keys), DELETE_BATCH):
            self.store.delete(keys[i : i + DELETE_BATCH])


def survey(scanned: dict[str, float | None], now: float) -> dict:
    """For reports: how many markers, how many unreadable, and the oldest one's age (s)."""
    written = [w for w in scanned.values() if w is not None]
    return {
        "markers": len(scanned),
        "unreadable": len(scanned) - len(written),
        "oldest_age_s": round(now - min(written), 3) if written else None,
    }
