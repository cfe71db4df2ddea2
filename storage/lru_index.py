"""The evictor's recency index: every page of the store, its size and when it was last touched.

Held in memory by the lease holder only, as numpy rows sorted by `id` (~60 bytes a page:
60 MB at 1M pages), and checkpointed to ``meta/index``. Folding a journal segment costs
O(segment log segment) plus one O(store) memory move; choosing victims is one O(store)
partition; neither reads the store, so an eviction pass costs the deletes it makes.

Order: oldest touch first; within one segment, record order (later is newer). The client
records each prefix deepest page first, so the deeper pages of a prefix go before its
earlier ones.
"""

from __future__ import annotations

import json
import struct
import time

import numpy as np

from hicache_jax.storage.journal import Segment
from hicache_jax.storage.keys import KINDS
from hicache_jax.storage.layout import PagePath

ROW = np.dtype(
    [
        ("id", "u8"),
        ("score", "f8"),  # last touch (Unix seconds), plus a nudge for the order within a segment
        ("size", "u4"),
        ("ns", "u4"),
        ("kind", "u1"),
        ("stuck", "u1"),  # removal failed: skipped by later passes (still counted in bytes)
        ("hash", "u1", (32,)),
    ]
)
_LEN = struct.Struct("<I")
_NUDGE = 1e-6  # seconds per position within one segment


def _ids(hashes: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """A page's identity: 62 bits of its hash, its kind in the low 2 bits."""
    head = hashes[:, :8].copy().view("<u8").reshape(-1)
    return (head & ~np.uint64(3)) | kinds.astype(np.uint64)


class LruIndex:
    def __init__(self) -> None:
        self.rows = np.zeros(0, ROW)
        self.ns_dirs: list[str] = []
        self._ns: dict[str, int] = {}

    # -- size ------------------------------------------------------------------------
    @property
    def pages(self) -> int:
        return len(self.rows)

    @property
    def total_bytes(self) -> int:
        return int(self.rows["size"].sum(dtype=np.int64))

    def _ns_id(self, ns_dir: str) -> int:
        if ns_dir not in self._ns:
            self._ns[ns_dir] = len(self.ns_dirs)
            self.ns_dirs.append(ns_dir)
        return self._ns[ns_dir]

    # -- updates ---------------------------------------------------------------------
    def fold(self, seg: Segment) -> None:
        """Merge one journal segment: new pages are added, known ones re-timed and re-sized."""
        rec = seg.records
        if not len(rec):
            return
        remap = np.array([self._ns_id(d) for d in seg.ns_dirs], np.uint32)
        new = np.zeros(len(rec), ROW)
        new["hash"] = rec["hash"]
        new["kind"] = rec["kind"]
        new["ns"] = remap[rec["ns"]]
        new["size"] = rec["size"]
        new["score"] = seg.t + _NUDGE * np.arange(len(rec))
        new["id"] = _ids(rec["hash"], rec["kind"])
        self.merge(new)

    def merge(self, new: np.ndarray) -> None:
        # One row per id, the latest touch winning.
        new = new[np.lexsort((-new["score"], new["id"]))]
        new = new[np.concatenate(([True], new["id"][1:] != new["id"][:-1]))]
        pos = np.searchsorted(self.rows["id"], new["id"])
        known = pos < len(self.rows)
        known[known] = self.rows["id"][pos[known]] == new["id"][known]
        at = pos[known]
        self.rows["score"][at] = np.maximum(self.rows["score"][at], new["score"][known])
        self.rows["size"][at] = new["size"][known]
        self.rows["stuck"][at] = 0
        self.rows = np.insert(self.rows, pos[~known], new[~known])

    def victims(self, nbytes: int) -> np.ndarray:
        """Row positions, oldest first, whose sizes sum to at least `nbytes` (or all that are
        not stuck), in eviction order."""
        if nbytes <= 0 or not len(self.rows):
            return np.zeros(0, np.int64)
        free = np.flatnonzero(self.rows["stuck"] == 0)
        mean = max(1.0, float(self.rows["size"][free].mean())) if len(free) else 1.0
        k = min(len(free), int(nbytes / mean * 1.25) + 16)
        while True:
            part = free if k >= len(free) else free[np.argpartition(self.rows["score"][free], k - 1)[:k]]
            part = part[np.argsort(self.rows["score"][part], kind="stable")]
            csum = np.cumsum(self.rows["size"][part], dtype=np.int64)
            n = int(np.searchsorted(csum, nbytes)) + 1
            if n <= len(part) or k >= len(free):
                return part[: min(n, len(part))]
            k = min(len(free), 2 * k)

    def paths(self, at: np.ndarray) -> list[str]:
        r = self.rows[at]
        return [
            PagePath(self.ns_dirs[ns], h.tobytes(), KINDS[kind]).path
            for ns, h, kind in zip(r["ns"].tolist(), r["hash"], r["kind"].tolist())
        ]

    def remove(self, at: np.ndarray) -> None:
        self.rows = np.delete(self.rows, at)

    def mark_stuck(self, at: np.ndarray) -> None:
        self.rows["stuck"][at] = 1

    def select(self, ns_prefix: str = "", older_than: float | None = None) -> np.ndarray:
        """Row positions of a namespace prefix (``<model>`` or a whole namespace dir) and/or
        last touched before `older_than` (Unix time), oldest first."""
        mask = np.ones(len(self.rows), bool)
        if ns_prefix:
            p = ns_prefix.strip("/")
            hit = np.array([d == p or d.startswith(p + "/") for d in self.ns_dirs] + [False])
            mask &= hit[self.rows["ns"]]
        if older_than is not None:
            mask &= self.rows["score"] < older_than
        at = np.flatnonzero(mask)
        return at[np.argsort(self.rows["score"][at], kind="stable")]

    # -- report ----------------------------------------------------------------------
    def report(self, now: float | None = None, ages=(3600, 86400, 7 * 86400)) -> dict:
        """{namespace dir: {"pages", "bytes", "by_age": {"<1h": bytes, ...}}}."""
        now = time.time() if now is None else now
        edges = [0, *ages, np.inf]
        names = [f"<{_human(a)}" for a in ages] + [f">={_human(ages[-1])}"]
        out = {}
        age = now - self.rows["score"]
        for i, d in enumerate(self.ns_dirs):
            m = self.rows["ns"] == i
            if not m.any():
                continue
            sizes, a = self.rows["size"][m].astype(np.int64), age[m]
            by_age = {
                name: int(sizes[(a >= lo) & (a < hi)].sum()) for name, lo, hi in zip(names, edges, edges[1:])
            }
            out[d] = {"pages": int(m.sum()), "bytes": int(sizes.sum()), "by_age": by_age}
        return out

    # -- checkpoint ------------------------------------------------------------------
    def encode(self, folded: list[str]) -> bytes:
        """The index plus the journal segments it holds (deleted after this is stored)."""
        header = json.dumps({"version": 1, "ns": self.ns_dirs, "folded": folded}).encode()
        return _LEN.pack(len(header)) + header + self.rows.tobytes()

    @classmethod
    def decode(cls, data: bytes) -> tuple[LruIndex, list[str]]:
        (n,) = _LEN.unpack_from(data)
        header = json.loads(data[4 : 4 + n])
        idx = cls()
        for d in header["ns"]:
            idx._ns_id(d)
        idx.rows = np.frombuffer(data, ROW, offset=4 + n).copy()
        return idx, list(header["folded"])


def _human(seconds: float) -> str:
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= s and seconds % s == 0:
            return f"{int(seconds // s)}{unit}"
    return f"{seconds:g}s"
