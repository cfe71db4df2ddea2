"""The L3 store on a TensorStore key-value store (`file` by default; `gs://`, `s3://`, ...).

Why these choices (measured on a 2-core VM with `benchmarks/l3_bandwidth.py`; the
layout and eviction at scale with `benchmarks/l3_scale.py`):
  * Reads are issued as futures and awaited in order, with up to `max_in_flight` (32)
    outstanding: one at a time ran at ~0.4-0.6x the bandwidth, and issuing a whole batch
    of 128 large pages at once was ~25-35% slower than a window of 8-32 (the unbounded
    burst of fresh buffers costs page faults; measured on 1.5 MiB and 64 KiB pages).
  * `exists` probes each key with a zero-length byte-range read (128 probes ~1.5 ms warm);
    `list` costs time in the size of the whole store (5,000 keys ~10-15 ms) instead of
    the size of the batch.
  * The `file` driver writes a temp file and renames it into place, so readers in other
    processes see whole values or nothing. `file_io_sync` defaults to False here: pages
    carry a checksum, so a page lost to power failure before its data reached the disk
    reads back as a checksum failure, i.e. a miss (and the client deletes it).
  * No `ocdbt` and no zarr sharding: a cache that evicts needs one object per page.
  * `timeout_s` bounds every batched call: TensorStore retries an unreachable S3 endpoint
    for minutes, so each call waits for its futures until one deadline, then cancels the
    rest and raises `TimeoutError`. (A hang below Python is thus bounded here; the client's
    `StoreGuard` bounds any store, including ones that hang in Python.)
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import tensorstore as ts

from hicache_jax.storage.base import L3Store
from hicache_jax.storage.stats import Counters

T = TypeVar("T")


class InvalidStoreSpec(ValueError):
    """The store spec could not be parsed or opened; the message names the spec."""


def resolve_spec(spec: Any, *, file_io_sync: bool | None = False) -> dict[str, Any]:
    """A TensorStore KvStore JSON spec from a local path, a URL, a JSON string or a dict.

    The result's `path` ends with "/" (keys are appended to it without a separator),
    and a `file` spec gets `file_io_sync` unless it sets its own.
    """
    if isinstance(spec, ts.KvStore.Spec):
        out = spec.to_json()
    elif isinstance(spec, dict):
        out = dict(spec)
    elif isinstance(spec, str | os.PathLike):
        text = os.fspath(spec).strip()
        if not text:
            raise InvalidStoreSpec("empty L3 store spec")
        if text.startswith("{"):
            try:
                out = json.loads(text)
            except json.JSONDecodeError as e:
                raise InvalidStoreSpec(f"L3 store spec {text!r} is not valid JSON: {e}") from e
        elif "://" in text:
            try:
                out = ts.KvStore.Spec(text).to_json()
            except ValueError as e:
                raise InvalidStoreSpec(f"L3 store URL {text!r} is not usable: {e}") from e
        else:
            out = {"driver": "file", "path": os.path.abspath(text)}
    else:
        raise InvalidStoreSpec(f"L3 store spec {spec!r} must be a path, URL, JSON string or dict")
    if not isinstance(out, dict) or "driver" not in out:
        raise InvalidStoreSpec(f"L3 store spec {spec!r} has no 'driver'")
    path = out.get("path", "")
    if path and not path.endswith("/"):
        out["path"] = path + "/"
    if out["driver"] == "file" and file_io_sync is not None:
        out.setdefault("file_io_sync", file_io_sync)
    return out


class TensorStoreL3(L3Store):
    """`L3Store` on `tensorstore.KvStore`. See `L3Store` for the semantics.

    Atomicity and sharing follow the driver: `file` (rename into place) and `gs`
    (per-object atomic writes) give whole-value visibility across processes and hosts;
    `memory` is private to this store object.
    """

    def __init__(
        self,
        spec: Any,
        *,
        file_io_concurrency: int | None = None,
        file_io_sync: bool | None = False,
        max_in_flight: int = 32,
        timeout_s: float | None = None,
    ):
        if max_in_flight <= 0:
            raise ValueError(f"max_in_flight must be > 0, got {max_in_flight}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (or None), got {timeout_s}")
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.spec = resolve_spec(spec, file_io_sync=file_io_sync)
        context = {}
        if file_io_concurrency is not None:
            if file_io_concurrency <= 0:
                raise ValueError(f"file_io_concurrency must be > 0, got {file_io_concurrency}")
            context["file_io_concurrency"] = {"limit": file_io_concurrency}
        try:
            self._kv = ts.KvStore.open(self.spec, context=ts.Context(context)).result()
        except ValueError as e:
            raise InvalidStoreSpec(f"cannot open L3 store {spec!r} ({self.spec}): {e}") from e
        self._closed = False
        self._stats = Counters(
            "pages_read",
            "bytes_read",
            "misses",
            "pages_written",
            "bytes_written",
            "skipped_puts",
            "deletes",
        )

    def __repr__(self) -> str:
        return f"TensorStoreL3({self.spec!r})"

    @property
    def url(self) -> str:
        return self._kv.url

    def _store(self) -> ts.KvStore:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        return self._kv

    def _deadline(self) -> float | None:
        """The Unix time by which the current call must end (TensorStore's clock)."""
        return None if self.timeout_s is None else time.time() + self.timeout_s

    def exists(self, keys: Sequence[str]) -> list[bool]:
        kv = self._store()
        probe = lambda k: kv.read(_check_key(k), byte_range=slice(0, 0))
        results = _windowed(probe, keys, self.max_in_flight, self._deadline())
        return [r.state == "value" for r in results]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        kv = self._store()
        read = lambda k: kv.read(_check_key(k))
        results = _windowed(read, keys, self.max_in_flight, self._deadline())
        out = [r.value if r.state == "value" else None for r in results]
        hits = [v for v in out if v is not None]
        self._stats.add(pages_read=len(hits), bytes_read=sum(map(len, hits)), misses=len(out) - len(hits))
        return out

    def put(self, items: Sequence[tuple[str, bytes]], *, force: bool = False) -> int:
        kv = self._store()
        unique = dict(items)  # one write per key (values of one key are equal by design)
        todo = list(unique.items())
        if not force and todo:
            present = self.exists([k for k, _ in todo])
            todo = [kv_item for kv_item, p in zip(todo, present, strict=True) if not p]
        _await_all((kv.write(_check_key(k), v) for k, v in todo), self._deadline())
        self._stats.add(
            pages_written=len(todo),
            bytes_written=sum(len(v) for _, v in todo),
            skipped_puts=len(items) - len(todo),
        )
        return len(todo)

    def delete(self, keys: Sequence[str]) -> None:
        kv = self._store()
        _await_all((kv.write(_check_key(k), None) for k in keys), self._deadline())
        self._stats.add(deletes=len(keys))

    def list_keys(self, prefix: str = "", end: str | None = None) -> list[str]:
        """Keys under this store's path that start with `prefix` (or, with `end`, lie in
        [prefix, end)). Costs time in the size of that range, not of the store."""
        if end is not None:
            rng = ts.KvStore.KeyRange(prefix, end)
        elif prefix:
            rng = ts.KvStore.KeyRange(prefix, _prefix_end(prefix))
        else:
            rng = ts.KvStore.KeyRange()
        return sorted(k.decode() for k in self._store().list(rng).result(deadline=self._deadline()))

    def read_generation(self, key: str) -> tuple[bytes | None, bytes]:
        r = self._store().read(_check_key(key)).result(deadline=self._deadline())
        return (r.value if r.state == "value" else None), r.stamp.generation

    def write_if(self, key: str, value: bytes | None, generation: bytes | None) -> bool:
        kv = self._store()
        if generation is None:
            kv.write(_check_key(key), value).result(deadline=self._deadline())
            return True
        stamp = kv.write(_check_key(key), value, if_equal=generation).result(deadline=self._deadline())
        return stamp.generation != b""

    def free_bytes(self) -> int | None:
        """Free bytes on a `file` store's file system (None for other drivers)."""
        if self.spec.get("driver") != "file":
            return None
        os.makedirs(self.spec["path"], exist_ok=True)
        return shutil.disk_usage(self.spec["path"]).free

    def close(self) -> None:
        self._closed = True

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()


def _prefix_end(prefix: str) -> str:
    """The least string greater than every string starting with `prefix`."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(f"invalid L3 key {key!r}")
    return key


def _windowed(
    start: Callable[[T], ts.Future], items: Iterable[T], window: int, deadline: float | None
) -> list:
    """Results of `start(item)` in order, with at most `window` futures outstanding; past
    `deadline` (Unix time) the outstanding futures are cancelled and TimeoutError raised."""
    pending: collections.deque[ts.Future] = collections.deque()
    out = []
    try:
        for item in items:
            if len(pending) >= window:
                out.append(pending.popleft().result(deadline=deadline))
            pending.append(start(item))
        while pending:
            out.append(pending.popleft().result(deadline=deadline))
    except TimeoutError:
        for f in pending:
            f.cancel()
        raise TimeoutError(f"L3 store: {len(pending)} operations still pending at the deadline") from None
    return out


def _await_all(futures: Iterable[ts.Future], deadline: float | None) -> None:
    """Issue and wait for every future (all in flight at once: writes hold no read buffers),
    then raise the first error, so no write is left running when this returns. Past
    `deadline` the unfinished ones are cancelled and TimeoutError raised."""
    futures = list(futures)
    first: BaseException | None = None
    for i, f in enumerate(futures):
        try:
            f.result(deadline=deadline)
        except TimeoutError:
            for g in futures[i:]:
                g.cancel()
            raise TimeoutError(f"L3 store: {len(futures) - i} writes still pending at the deadline") from None
        except Exception as e:  # noqa: BLE001 - re-raised below after the rest finish
            first = first or e
    if first is not None:
        raise first
