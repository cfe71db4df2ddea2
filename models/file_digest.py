"""Content digests of checkpoint files: every byte hashed once, then remembered beside them.

    digest(file) = SHA-256("hicache-jax file digest v1" || u64 size || SHA-256(chunk_0) || ...)

over fixed 16 MiB chunks, so chunks hash in parallel threads (hashlib releases the GIL on
large buffers) and the value never depends on how many threads ran.

A digest is remembered under the file's name and stat signature (size, mtime_ns, ctime_ns),
in a JSON sidecar (``.hicache_digests.json``) beside the files; where that directory is
read-only, in the user cache directory; where that fails too, only in this process.
Invariant: a remembered digest is reused only for a file whose signature is unchanged since
it was hashed. Any write to a file moves its mtime and ctime, and a copy gets a fresh ctime
(which no user-level tool can set back), so a copied or edited checkpoint is hashed again;
a digest whose file changed while it was being hashed is never remembered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

CHUNK = 16 << 20
SIDECAR = ".hicache_digests.json"
_VERSION = 1
_TAG = b"hicache-jax file digest v1"

_memo: dict[tuple, str] = {}  # (realpath, signature) -> digest, for this process
_memo_lock = threading.Lock()


def forget(directory: str | None = None) -> None:
    """Drop this process's remembered digests, and ``directory``'s sidecars (benchmarks)."""
    with _memo_lock:
        _memo.clear()
    for sidecar in _sidecars(directory) if directory else ():
        try:
            os.unlink(sidecar)
        except FileNotFoundError:
            pass


def signature(path: str) -> list[int]:
    """What must be unchanged for a remembered digest of ``path`` to hold."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def hash_file(path: str, threads: int | None = None) -> str:
    """The digest of every byte of ``path`` (no caching). Read with ``preadv`` rather than
    mmap: a file truncated under us gives a short read (an OSError here), never a SIGBUS."""
    threads = threads or min(8, os.cpu_count() or 1)
    local = threading.local()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def chunk(start: int) -> bytes:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(CHUNK)  # one buffer per thread, reused
            want = min(CHUNK, size - start)
            if os.preadv(fd, [memoryview(buf)[:want]], start) != want:
                raise OSError(f"{path}: shorter than {size} bytes (changed while hashing)")
            return hashlib.sha256(memoryview(buf)[:want]).digest()

        starts = range(0, size, CHUNK)
        with ThreadPoolExecutor(max(1, min(threads, len(starts)))) as pool:
            parts = list(pool.map(chunk, starts))
    finally:
        os.close(fd)
    return hashlib.sha256(_TAG + struct.pack("<Q", size) + b"".join(parts)).hexdigest()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache_jax", "digests")


def _sidecars(directory: str) -> list[str]:
    """Where a directory's digests may be remembered, best first."""
    real = os.path.realpath(directory)
    name = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:32] + ".json"
    return [os.path.join(directory, SIDECAR), os.path.join(_cache_dir(), name)]


def _read_sidecar(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("version") == _VERSION else None
    return files if isinstance(files, dict) else {}


def _write_sidecar(path: str, files: dict) -> bool:
    """Atomically (temp file + rename): a reader never sees half a sidecar."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".hicache_digests.", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _VERSION, "files": files}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


def file_digests(directory: str, names: list[str]) -> dict[str, str]:
    """``{name: digest}`` for files in ``directory``: remembered ones reused, others hashed
    (and remembered). Raises OSError if a file cannot be read."""
    real = os.path.realpath(directory)
    sigs = {n: signature(os.path.join(directory, n)) for n in names}
    remembered = [_read_sidecar(s) for s in _sidecars(directory)]
    out: dict[str, str] = {}
    fresh = False
    for n in names:
        with _memo_lock:
            known = _memo.get((real, n, tuple(sigs[n])))
        for files in remembered:
            entry = files.get(n)
            if known is None and isinstance(entry, dict) and entry.get("signature") == sigs[n]:
                known = entry.get("digest")
        if not isinstance(known, str):
            known = hash_file(os.path.join(directory, n))
            if signature(os.path.join(directory, n)) != sigs[n]:
                raise OSError(f"{os.path.join(directory, n)} changed while it was being hashed")
            fresh = True
        out[n] = known
        with _memo_lock:
            _memo[(real, n, tuple(sigs[n]))] = known
    if fresh:
        files = {n: {"signature": sigs[n], "digest": out[n]} for n in names}
        if not any(_write_sidecar(s, files) for s in _sidecars(directory)):
            log.info("could not remember digests of %s on disk; kept in memory", directory)
    return out
