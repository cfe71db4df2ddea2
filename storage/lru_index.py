"""The evictor's recency index: every page of the store, its size and when it was last touched.

Held in memory by the lease holder only, as numpy columns sorted by page id (~58 bytes a
page: 58 MB at 1M pages), and checkpointed to ``meta/index``. Folding a journal segment
costs O(segment log segment) plus one O(store) memory move when it adds pages; choosing
victims is one O(store) partition of a float array (milliseconds at 1M pages); removing
them costs the rows removed. Neither reads the store: an eviction pass costs its deletes.

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

_COLUMNS = {  # one numpy array per column, kept sorted by id
    "id": np.uint64,  # 62 bits of the page hash, its kind in the low 2 bits
    "score": np.float64,  # last touch (Unix seconds), plus a nudge for the order within a segment
    "size": np.uint32,  # value bytes; 0 for a removed row
    "ns": np.uint32,  # index into ns_dirs
    "kind": np.uint8,
    "stuck": np.uint8,  # 1: removal failed, or the row is removed: never a victim
}
_LEN = struct.Struct("<I")
_NUDGE = 1e-6  # seconds per position within one segment
_COMPACT = 0.25  # removed rows are dropped once they are this share of the index


def _ids(hashes: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """A page's identity: 62 bits of its hash, its kind in the low 2 bits."""
    head = np.ascontiguousarray(hashes[:, :8]).view("<u8").reshape(-1)
    return (head & ~np.uint64(3)) | kinds.astype(np.uint64)


def _empty(n: int = 0) -> dict[str, np.ndarray]:
    cols = {name: np.zeros(n, dtype) for name, dtype in _COLUMNS.items()}
    cols["hash"] = np.zeros((n, 32), np.uint8)
    return cols


class LruIndex:
    """Columns sorted by page id. A removed page's row stays (size 0, stuck) until removed
    rows are a quarter of the index, so an eviction pass costs the rows it removes."""

    def __init__(self) -> None:
        self.cols = _empty()
        self.ns_dirs: list[str] = []
        self._ns: dict[str, int] = {}
        self._removed = 0

    # -- size ------------------------------------------------------------------------
    @property
    def pages(self) -> int:
        return len(self.cols["id"]) - self._removed

    @property
    def total_bytes(self) -> int:
        return int(self.cols["size"].sum(dtype=np.int64))

    def bytes_of(self, at: np.ndarray) -> int:
        return int(self.cols["size"][at].sum(dtype=np.int64))

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
        new = _empty(len(rec))
        new["hash"][:] = rec["hash"]
        new["kind"][:] = rec["kind"]
        new["ns"][:] = remap[rec["ns"]]
        new["size"][:] = rec["size"]
        new["score"][:] = seg.t + _NUDGE * np.arange(len(rec))
        new["id"][:] = _ids(rec["hash"], rec["kind"])
        self.merge(new)

    def merge(self, new: dict[str, np.ndarray]) -> None:
        # One row per id, the latest touch winning.
        order = np.lexsort((-new["score"], new["id"]))
        ids = new["id"][order]
        order = order[np.concatenate(([True], ids[1:] != ids[:-1]))]
        new = {k: v[order] for k, v in new.items()}
        cur = self.cols
        pos = np.searchsorted(cur["id"], new["id"])
        known = pos < len(cur["id"])
        known[known] = cur["id"][pos[known]] == new["id"][known]
        at = pos[known]
        self._removed -= int(np.count_nonzero(cur["size"][at] == 0))  # a removed page came back
        cur["score"][at] = np.maximum(cur["score"][at], new["score"][known])
        cur["size"][at] = new["size"][known]
        cur["stuck"][at] = 0
        fresh = ~known
        if fresh.any():
            self.cols = {k: np.insert(cur[k], pos[fresh], new[k][fresh], axis=0) for k in cur}

    def victims(self, nbytes: int, exclude: np.ndarray | None = None) -> np.ndarray:
        """Row positions, oldest first, whose sizes sum to at least `nbytes` (or every row
        that is not stuck or in `exclude`), in eviction order."""
        if nbytes <= 0 or not self.pages:
            return np.zeros(0, np.int64)
        score, size = self.cols["score"], self.cols["size"]
        blocked = self.cols["stuck"] != 0
        if exclude is not None:
            blocked[exclude] = True
        free = len(score) - int(np.count_nonzero(blocked))
        if free < len(score):
            score = np.where(blocked, np.inf, score)  # never chosen
        k = min(free, int(nbytes * self.pages / max(1, self.total_bytes) * 1.25) + 16)
        while True:
            part = np.argpartition(score, k - 1)[:k] if k < len(score) else np.arange(len(score))
            part = part[np.argsort(score[part], kind="stable")][:free]
            csum = np.cumsum(size[part], dtype=np.int64)
            n = int(np.searchsorted(csum, nbytes)) + 1
            if n <= len(part) or k >= free:
                return part[: min(n, len(part))]
            k = min(free, 2 * k)

    def paths(self, at: np.ndarray) -> list[str]:
        c = self.cols
        return [
            PagePath(self.ns_dirs[ns], h.tobytes(), KINDS[kind]).path
            for ns, h, kind in zip(c["ns"][at].tolist(), c["hash"][at], c["kind"][at].tolist())
        ]

    def remove(self, at: np.ndarray) -> None:
        at = at[self.cols["size"][at] > 0]
        self.cols["size"][at] = 0
        self.cols["stuck"][at] = 1
        self._removed += len(at)
        if self._removed > _COMPACT * len(self.cols["id"]):
            self.compact()

    def compact(self) -> None:
        keep = self.cols["size"] > 0
        self.cols = {k: v[keep] for k, v in self.cols.items()}
        self._removed = 0

    def mark_stuck(self, at: np.ndarray) -> None:
        self.cols["stuck"][at] = 1

    def select(self, ns_prefix: str = "", older_than: float | None = None) -> np.ndarray:
        """Row positions of a namespace prefix (``<model>`` or a whole namespace dir) and/or
        last touched before `older_than` (Unix time), oldest first."""
        mask = self.cols["size"] > 0
        if ns_prefix:
            p = ns_prefix.strip("/")
            hit = np.array([d == p or d.startswith(p + "/") for d in self.ns_dirs] + [False])
            mask &= hit[self.cols["ns"]]
        if older_than is not None:
            mask &= self.cols["score"] < older_than
        at = np.flatnonzero(mask)
        return at[np.argsort(self.cols["score"][at], kind="stable")]

    # -- report ----------------------------------------------------------------------
    def report(self, now: float | None = None, ages=(3600, 86400, 7 * 86400)) -> dict:
        """{namespace dir: {"pages", "bytes", "by_age": {"<1h": bytes, ...}}}."""
        now = time.time() if now is None else now
        edges = [0, *ages, np.inf]
        names = [f"<{_human(a)}" for a in ages] + [f">={_human(ages[-1])}"]
        out = {}
        age = now - self.cols["score"]
        live = self.cols["size"] > 0
        for i, d in enumerate(self.ns_dirs):
            m = live & (self.cols["ns"] == i)
            if not m.any():
                continue
            sizes, a = self.cols["size"][m].astype(np.int64), age[m]
            by_age = {
                name: int(sizes[(a >= lo) & (a < hi)].sum()) for name, lo, hi in zip(names, edges, edges[1:])
            }
            out[d] = {"pages": int(m.sum()), "bytes": int(sizes.sum()), "by_age": by_age}
        return out

    # -- checkpoint ------------------------------------------------------------------
    def encode(self, folded: list[str]) -> bytes:
        """The index plus the journal segments it holds (deleted after this is stored)."""
        self.compact()
        n = len(self.cols["id"])
        header = json.dumps({"version": 2, "rows": n, "ns": self.ns_dirs, "folded": folded}).encode()
        return b"".join(
            [_LEN.pack(len(header)), header, *(self.cols[k].tobytes() for k in (*_COLUMNS, "hash"))]
        )

    @classmethod
    def decode(cls, data: bytes) -> tuple[LruIndex, list[str]]:
        (n,) = _LEN.unpack_from(data)
        header = json.loads(data[4 : 4 + n])
        if header.get("version") != 2:
            raise ValueError(f"unknown L3 index version {header.get('version')}")
        idx = cls()
        for d in header["ns"]:
            idx._ns_id(d)
        rows, offset = header["rows"], 4 + n
        for name, dtype in (*_COLUMNS.items(), ("hash", np.uint8)):
            count = rows * (32 if name == "hash" else 1)
            col = np.frombuffer(data, dtype, count=count, offset=offset).copy()
            idx.cols[name] = col.reshape(rows, 32) if name == "hash" else col
            offset += col.nbytes
        return idx, list(header["folded"])


def _human(seconds: float) -> str:
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= s and seconds % s == 0:
            return f"{int(seconds // s)}{unit}"
    return f"{seconds:g}s"
