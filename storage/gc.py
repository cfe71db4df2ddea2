"""Offline L3 maintenance: report a store's size by namespace and age; sweep it down.

    python -m hicache_jax.storage.gc --spec=/data/l3                       # report
    python -m hicache_jax.storage.gc --spec=/data/l3 --max_gb=500 --dry_run
    python -m hicache_jax.storage.gc --spec=gs://bucket/l3 --older_than=7d
    python -m hicache_jax.storage.gc --spec=/data/l3 --namespace=<model>[/<fields>/<salt>]
    python -m hicache_jax.storage.gc --spec=/data/l3 --drop_legacy      # old flat pages

The report also sums pages and bytes per KV page dtype (``kv_dtypes``: the namespace dir's
``kv_dtype=`` field, layout.py), so a store shared by bfloat16 and 8-bit servers shows what
each holds and its bytes per page. A namespace whose fields were too long for a path (hashed
to ``h-...``: an int8 scale digest, a page-auth id) is named by one of its KV pages instead:
the dtype its header gives (one page read per such namespace; ``unknown`` if none reads).

Every sweep deletes only keys named as this project names pages (layout.py) and handover
markers (handover.py): other files in the store are never listed for deletion. The report
counts the prefill -> decode handover markers and gives the oldest one's age; every sweep
also removes the markers the fleet evictor would (unreadable, older than 10 minutes, the
oldest past 10,000), and ``--older_than`` any marker older than it too.

It works from the same recency index the servers' evictor keeps (``meta/index`` plus the
journal) and takes the same lease, so it never runs beside a server's eviction pass (it
waits up to --lease_wait_s for a live server's lease). ``--rebuild`` re-creates the index
by listing the store (file stores: size and mtime from the file system; object stores: sizes
by reading each page, ages set to now), for stores served without a capacity limit.

Age sweeps on object stores can also be left to the bucket: a lifecycle rule on the prefix
``<path>/pages/`` that deletes objects N days after creation (GCS: ``{"action": {"type":
"Delete"}, "condition": {"age": N, "matchesPrefix": ["<path>/pages/"]}}``; S3:
``Expiration: {Days: N}`` with ``Filter: {Prefix: "<path>/pages/"}``). It ages by write
time, not last use, and the index keeps counting those pages until an eviction pass or a
``--rebuild`` notices: deleting a missing page is a no-op, so that is harmless.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np
from absl import app, flags
from tqdm import tqdm

from hicache_jax.storage.capacity import Capacity, CapacityConfig
from hicache_jax.storage.codec import CorruptPage, decode_page
from hicache_jax.storage.handover import HandoverBoard, survey
from hicache_jax.storage.journal import encode_records
from hicache_jax.storage.keys import KINDS
from hicache_jax.storage.layout import LEGACY_RANGE, PAGES, is_legacy_key, namespace_prefix, parse_page_path
from hicache_jax.storage.lru_index import LruIndex
from hicache_jax.storage.tensorstore_store import TensorStoreL3

# Page kinds whose values are KV (in the --kv_cache_dtype); the others are states.
KV_KINDS = ("kv", "swa", "mla", "idx", "csa", "hca")
_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d' (or plain seconds) -> seconds."""
    m = _AGE.match(text.strip())
    if not m:
        raise ValueError(f"bad age {text!r}: use e.g. 90s, 30m, 12h or 7d")
    return float(m.group(1)) * _UNIT[m.group(2)]


def kv_dtype_of(ns_dir: str) -> str:
    """The ``kv_dtype=`` field of a namespace dir (``<model>/<fields>/<salt>``), or
    ``unknown`` (fields hashed for length, or none named)."""
    parts = ns_dir.split("/")
    fields = parts[1] if len(parts) > 1 else ""
    for field in fields.split(","):
        name, _, value = field.partition("=")
        if name == "kv_dtype" and value:
            return value
    return "unknown"


def by_kv_dtype(namespaces: dict, dtypes: dict[str, str]) -> dict:
    """{kv dtype: {"pages", "bytes", "bytes_per_page"}} summed over namespace dirs
    (``dtypes``: each dir's KV dtype)."""
    out: dict[str, dict] = {}
    for ns_dir, r in namespaces.items():
        row = out.setdefault(dtypes[ns_dir], {"pages": 0, "bytes": 0})
        row["pages"] += r["pages"]
        row["bytes"] += r["bytes"]
    for row in out.values():
        row["bytes_per_page"] = row["bytes"] / row["pages"] if row["pages"] else 0.0
    return dict(sorted(out.items()))


class Collector:
    """One gc session on a store: holds the evictor lease while it works."""

    def __init__(self, store, *, lease_wait_s: float = 60.0, quiet: bool = False):
        self.store = store
        self.quiet = quiet
        self.cap = Capacity(lambda: store, CapacityConfig(), server_id=f"gc-{os.getpid()}", start=False)
        deadline = time.monotonic() + lease_wait_s
        while not self.cap.sync():
            if time.monotonic() > deadline:
                raise RuntimeError(f"another process holds the L3 evictor lease on {store!r}; try later")
            time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))

    @property
    def index(self) -> LruIndex:
        return self.cap.index

    def report(self) -> dict:
        idx = self.index
        markers = survey(HandoverBoard(self.store).scan(), time.time())
        namespaces = idx.report()
        dtypes = {d: kv_dtype_of(d) for d in namespaces}
        dtypes.update({d: self.stored_kv_dtype(d) for d, t in dtypes.items() if t == "unknown"})
        return {
            "pages": idx.pages,
            "bytes": idx.total_bytes,
            "namespaces": namespaces,
            "kv_dtypes": by_kv_dtype(namespaces, dtypes),
            "handover": markers,
        }

    def stored_kv_dtype(self, ns_dir: str, tries: int = 4) -> str:
        """The dtype of a KV page of namespace dir `ns_dir`, from its header (a state page
        keeps its own dtype, so it is never the one read); ``unknown`` if none reads."""
        idx = self.index
        at = idx.select(ns_dir)
        kv = np.isin(idx.cols["kind"][at], [KINDS.index(k) for k in KV_KINDS])
        paths = idx.paths(at[kv][:tries])
        for value in self.store.get(paths) if paths else []:
            if value is None or len(value) < 16:
                continue
            try:  # the page's own namespace fingerprint: only its checksum and format are checked
                arrays = decode_page(value, bytes(value[8:16]).hex())
            except CorruptPage:
                continue
            return next(iter(arrays.values())).dtype.name
        return "unknown"

    def sweep_markers(self, older_than_s: float | None = None, *, dry_run: bool) -> dict:
        """Remove handover markers past the evictor's bounds (`CapacityConfig`), and any
        older than `older_than_s`; returns how many were (or, dry, would be) removed."""
        cfg = self.cap.cfg
        max_age = (
            cfg.handover_max_age_s if older_than_s is None else min(older_than_s, cfg.handover_max_age_s)
        )
        board = HandoverBoard(self.store, max_markers=cfg.handover_max_markers, max_age_s=max_age)
        n = len(board.expired(board.scan())) if dry_run else board.sweep()
        return {"markers": n, "dry_run": dry_run}

    def select(self, *, max_bytes: int | None = None, older_than_s: float | None = None, namespace: str = ""):
        """Index rows to remove, oldest first: a namespace (and/or older than an age), or
        the oldest pages down to `max_bytes`."""
        idx = self.index
        if namespace or older_than_s is not None:
            cutoff = None if older_than_s is None else time.time() - older_than_s
            at = idx.select(namespace, cutoff)
        else:
            at = np.zeros(0, np.int64)
        if max_bytes is not None:
            over = idx.total_bytes - idx.bytes_of(at) - max_bytes
            if over > 0:
                at = np.concatenate([at, idx.victims(over, exclude=at)])
        return at

    def sweep(self, at: np.ndarray, *, dry_run: bool, namespace: str = "") -> dict:
        """Remove rows `at` (and, for a namespace, every page under its prefix, indexed
        or not); returns what was (or, dry, would be) removed."""
        idx = self.index
        pages, nbytes = len(at), idx.bytes_of(at)
        extra: list[str] = []
        if namespace:  # pages only: another program's files under the prefix stay
            indexed = set(idx.paths(at))
            listed = self.store.list_keys(namespace_prefix(namespace))
            extra = [k for k in listed if k not in indexed and parse_page_path(k) is not None]
        out = {"pages": pages + len(extra), "bytes": nbytes, "unindexed_pages": len(extra)}
        out["dry_run"] = dry_run
        if dry_run:
            return out
        with tqdm(total=pages + len(extra), unit="page", disable=self.quiet, desc="sweep") as bar:
            out["bytes"] = self.cap.remove(at, progress=bar.update)
            for i in range(0, len(extra), self.cap.cfg.delete_batch):
                batch = extra[i : i + self.cap.cfg.delete_batch]
                self.store.delete(batch)
                bar.update(len(batch))
        out["skipped_unremovable"] = self.cap.counters["evict_skipped_unremovable"]
        self.cap.checkpoint()
        return out

    def drop_legacy(self, *, dry_run: bool) -> dict:
        keys = [k for k in self.store.list_keys(*LEGACY_RANGE) if is_legacy_key(k)]
        if not dry_run:
            for i in tqdm(range(0, len(keys), 256), disable=self.quiet, desc="drop legacy"):
                self.store.delete(keys[i : i + 256])
        return {"pages": len(keys), "dry_run": dry_run}

    def rebuild(self) -> dict:
        """Re-create the index from a listing of every page (keys of the page layout only:
        another program's files under ``pages/`` are neither indexed nor ever evicted)."""
        keys = [k for k in self.store.list_keys(PAGES) if parse_page_path(k) is not None]
        root = self.store.spec.get("path") if self.store.spec.get("driver") == "file" else None
        idx = LruIndex()
        for i in tqdm(range(0, len(keys), 1024), disable=self.quiet, desc="rebuild"):
            batch = keys[i : i + 1024]
            if root is not None:
                stats = [os.stat(os.path.join(root, k)) for k in batch]
                times, sizes = [s.st_mtime for s in stats], [s.st_size for s in stats]
            else:
                values = self.store.get(batch)
                times, sizes = [time.time()] * len(batch), [len(v or b"") for v in values]
            for t, key, size in zip(times, batch, sizes):
                idx.fold(encode_records(t, [(key, size)]))
        self.cap.index = idx
        self.cap.checkpoint()
        return {"pages": idx.pages, "bytes": idx.total_bytes}

    def close(self) -> None:
        self.cap.lease.release()
        self.cap.guard.close()


FLAGS = flags.FLAGS
flags.DEFINE_string("spec", None, "The L3 store: a directory, a kvstore URL or a JSON spec.")
flags.DEFINE_float("max_gb", None, "Sweep the least recently used pages until the store holds this many GB.")
flags.DEFINE_string(
    "older_than", None, "Sweep pages not used, and handover markers written, this long ago (e.g. 12h, 7d)."
)
flags.DEFINE_string("namespace", None, "Sweep one namespace dir (<model>[/<fields>/<salt>]).")
flags.DEFINE_bool("drop_legacy", False, "Delete pages of the old flat layout.")
flags.DEFINE_bool("rebuild", False, "Re-create the recency index by listing the store first.")
flags.DEFINE_bool("dry_run", False, "Say what a sweep would remove; remove nothing.")
flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
flags.DEFINE_float("lease_wait_s", 60.0, "How long to wait for a live server's evictor lease.")


def _table(report: dict) -> str:
    ages = next(iter(report["namespaces"].values()), {}).get("by_age", {})
    head = f"{'namespace':<60} {'pages':>10} {'GB':>9} " + " ".join(f"{a:>9}" for a in ages)
    lines = [head, "-" * len(head)]
    for ns, r in sorted(report["namespaces"].items(), key=lambda kv: -kv[1]["bytes"]):
        row = f"{ns[:60]:<60} {r['pages']:>10} {r['bytes'] / 1e9:>9.3f} "
        lines.append(row + " ".join(f"{b / 1e9:>9.3f}" for b in r["by_age"].values()))
    lines.append(f"{'total':<60} {report['pages']:>10} {report['bytes'] / 1e9:>9.3f}")
    for dtype, r in report.get("kv_dtypes", {}).items():
        per_page = f"{r['bytes_per_page'] / 1024:.1f} KiB/page"
        lines.append(f"{'kv_dtype=' + dtype:<60} {r['pages']:>10} {r['bytes'] / 1e9:>9.3f} {per_page:>13}")
    markers = report.get("handover")
    if markers is not None:
        oldest = "" if markers["oldest_age_s"] is None else f", oldest {markers['oldest_age_s']:.0f} s old"
        lines.append(f"handover markers: {markers['markers']} ({markers['unreadable']} unreadable{oldest})")
    return "\n".join(lines)


def main(argv) -> None:
    del argv
    if not FLAGS.spec:
        raise app.UsageError("--spec is required")
    store = TensorStoreL3(FLAGS.spec)
    gc = Collector(store, lease_wait_s=FLAGS.lease_wait_s, quiet=FLAGS.json)
    try:
        out: dict = {}
        if FLAGS.drop_legacy:
            out["drop_legacy"] = gc.drop_legacy(dry_run=FLAGS.dry_run)
        if FLAGS.rebuild:
            out["rebuild"] = gc.rebuild()
        sweeping = FLAGS.max_gb is not None or FLAGS.older_than or FLAGS.namespace
        if sweeping:
            at = gc.select(
                max_bytes=None if FLAGS.max_gb is None else int(FLAGS.max_gb * 1e9),
                older_than_s=None if not FLAGS.older_than else parse_age(FLAGS.older_than),
                namespace=FLAGS.namespace or "",
            )
            out["sweep"] = gc.sweep(at, dry_run=FLAGS.dry_run, namespace=FLAGS.namespace or "")
            older = None if not FLAGS.older_than else parse_age(FLAGS.older_than)
            out["handover_sweep"] = gc.sweep_markers(older, dry_run=FLAGS.dry_run)
        out["report"] = gc.report()
        if FLAGS.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                if k != "report":
                    print(f"{k}: {v}")
            print(_table(out["report"]))
    finally:
        gc.close()
        store.close()


def run() -> None:
    """Console script entry point (``hicache-jax-storage-gc``)."""
    app.run(main, argv=sys.argv)


if __name__ == "__main__":
    run()
