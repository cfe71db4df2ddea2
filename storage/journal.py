"""The recency journal: pages read or written, recorded in memory and flushed in batches.

A server never writes per hit. `RecencyLog.record` appends to an in-memory buffer (bounded:
past `max_pending` records the oldest are dropped and counted); the capacity thread writes
the buffer as ONE object ``meta/journal/<ms>-<server>-<seq>`` every tick. The evictor folds
segments into its index (lru_index.py) and deletes them once a checkpoint holds them.

Segment format: a u32 length, a JSON header (time, namespace dirs), then fixed-size records
(`RECORD`) in the order the pages were touched -- a prefix's pages in prefix order.
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time

import numpy as np

from hicache_jax.storage.keys import KINDS
from hicache_jax.storage.layout import META, PagePath, parse_page_path

JOURNAL = META + "journal/"
# The name `RecencyLog.take` gives an object: ms since the epoch, server id, sequence number.
_NAME = re.compile(r"^" + re.escape(JOURNAL) + r"\d{15}-[A-Za-z0-9._-]+-\d{8}$")
RECORD = np.dtype([("hash", "u1", (32,)), ("kind", "u1"), ("ns", "u2"), ("size", "u4")])
_LEN = struct.Struct("<I")


class Segment:
    """One decoded journal object: records plus the namespace dirs they index into."""

    def __init__(self, t: float, ns_dirs: list[str], records: np.ndarray):
        self.t = t
        self.ns_dirs = ns_dirs
        self.records = records

    def encode(self) -> bytes:
        header = json.dumps({"t": self.t, "ns": self.ns_dirs}).encode()
        return _LEN.pack(len(header)) + header + self.records.tobytes()

    @classmethod
    def decode(cls, data: bytes) -> Segment:
        (n,) = _LEN.unpack_from(data)
        header = json.loads(data[4 : 4 + n])
        records = np.frombuffer(data, RECORD, offset=4 + n).copy()
        return cls(float(header["t"]), list(header["ns"]), records)


class RecencyLog:
    """Touches of this server not yet written to the journal. Thread-safe."""

    def __init__(self, server_id: str, max_pending: int = 1 << 16, clock=time.time):
        self.server_id = server_id
        self.max_pending = max_pending
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # key -> size, in first-touch order (dict order)
        self._seq = 0
        self.dropped = 0

    def record(self, items) -> None:
        """`items`: (store key, value size) pairs; keys not of the page layout are ignored."""
        with self._lock:
            for key, size in items:
                self._pending.pop(key, None)  # re-touched: move to the end
                self._pending[key] = size
            while len(self._pending) > self.max_pending:
                self._pending.pop(next(iter(self._pending)))
                self.dropped += 1

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def drop(self, ns_prefix: str = "") -> None:
        """Forget touches of pages under `ns_prefix` (a namespace dir or its start; "": all):
        those pages were cleared, a record of them would bring them back into the index."""
        p = ns_prefix.strip("/")
        with self._lock:
            for key in list(self._pending):
                page = parse_page_path(key)
                if not p or page is None or page.ns_dir == p or page.ns_dir.startswith(p + "/"):
                    del self._pending[key]

    def take(self) -> tuple[str, Segment] | None:
        """The buffer as one journal object (key, segment), emptying it; None if empty."""
        with self._lock:
            items, self._pending = list(self._pending.items()), {}
            self._seq += 1
            seq = self._seq
        if not items:
            return None
        t = self._clock()
        seg = encode_records(t, items)
        if not len(seg.records):
            return None
        return f"{JOURNAL}{int(t * 1000):015d}-{self.server_id}-{seq:08d}", seg

    def put_back(self, segment: Segment) -> None:
        """A segment that could not be written: keep its touches for the next tick."""
        with self._lock:
            older = dict(zip(segment_keys(segment), segment.records["size"].tolist()))
            older.update(self._pending)
            self._pending = older


def is_journal_key(key: str) -> bool:
    """Whether `key` is named as this project names journal objects."""
    return bool(_NAME.match(key))


def encode_records(t: float, items) -> Segment:
    ns_dirs: dict[str, int] = {}
    rows = []
    for key, size in items:
        p = parse_page_path(key)
        if p is None:
            continue
        ns = ns_dirs.setdefault(p.ns_dir, len(ns_dirs))
        rows.append((np.frombuffer(p.hash, np.uint8), KINDS.index(p.kind), ns, size))
    records = np.array(rows, dtype=RECORD) if rows else np.zeros(0, RECORD)
    return Segment(t, list(ns_dirs), records)


def segment_keys(segment: Segment) -> list[str]:
    return [
        PagePath(segment.ns_dirs[r["ns"]], r["hash"].tobytes(), KINDS[r["kind"]]).path
        for r in segment.records
    ]
