"""L3 bandwidth: the TensorStore `file` backend beside raw files on the same disk, same run.

For each page value size, the same number of pages and bytes go through:
  raw  plain files written and read by a thread pool (as many threads as TensorStore's
       `file_io_concurrency`), one file per page;
  L3   `TensorStoreL3.put/get` in batches of 128 pages, all reads of a batch in flight;
  client  `StorageClient.prefetch` of codec pages (adds the crc32 check and decode).
Reads are "cold-ish": page cache can't be dropped here, so after writing, the files are
synced and `posix_fadvise(DONTNEED)`ed, and the resident share left (via `fincore`, when
installed) is printed. Warm reads follow.

    python benchmarks/l3_bandwidth.py [--sizes 64K,1536K] [--total_mib 256] [--dir /tmp]

`main()` runs every entry of `SECTIONS`: the storage throughput above, and the TTFT of a
4096-token prompt on the ~100M preset served from L3 after a flush, against a cold prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.tensorstore_store import TensorStoreL3

BATCH = 128  # pages per L3 batch, as StorageClient reads and writes them


# -- page cache control --------------------------------------------------------------
def _evict(paths: Sequence[Path]) -> bool:
    """Sync, then ask the kernel to drop the files' cached pages; False if unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()  # DONTNEED drops clean pages only
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _resident_share(paths: Sequence[Path]) -> float | None:
    """Share of the files' bytes in page cache (util-linux `fincore`), None if unknown."""
    if not shutil.which("fincore"):
        return None
    total = resident = 0
    for i in range(0, len(paths), 512):
        chunk = [str(p) for p in paths[i : i + 512]]
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *chunk],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        for line in out.split("\n"):
            if line.strip():
                res, size = map(int, line.split())
                resident, total = resident + res, total + size
    return resident / total if total else None


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


# -- the three contenders ------------------------------------------------------------
def _raw_write(d: Path, names: Sequence[str], value: bytes, threads: int, sync: bool) -> None:
    # os.open/os.write rather than open(): the leanest plain-Python path, so the raw
    # baseline is not handicapped by per-file object overhead on small pages.
    def one(name: str) -> None:
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, value)
            if sync:  # the same durability as TensorStore's file_io_sync
                os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, names))


def _raw_read(d: Path, names: Sequence[str], size: int, threads: int) -> int:
    def one(name: str) -> bytes:
        fd = os.open(d / name, os.O_RDONLY)
        try:
            return os.read(fd, size)
        finally:
            os.close(fd)

    # Like L3 get(): each batch's bytes are all in memory together before they are dropped
    # (reading into one reused buffer would skip the allocation cost every consumer pays).
    with ThreadPoolExecutor(threads) as pool:
        n = 0
        for i in range(0, len(names), BATCH):
            n += sum(map(len, list(pool.map(one, names[i : i + BATCH]))))
        return n


def _l3_write(store: TensorStoreL3, names: Sequence[str], value: bytes) -> None:
    for i in range(0, len(names), BATCH):
        store.put([(n, value) for n in names[i : i + BATCH]], force=True)


def _l3_read(store: TensorStoreL3, names: Sequence[str]) -> int:
    n = 0
    for i in range(0, len(names), BATCH):
        n += sum(len(v) for v in store.get(names[i : i + BATCH]) if v is not None)
    return n


def _timed(fn: Callable[..., object], *fn_args: object) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*fn_args)
    return time.perf_counter() - t, out


# -- the storage section -------------------------------------------------------------
def bench_storage(args: argparse.Namespace) -> dict:
    """Write, cold-read and warm-read throughput: raw files vs L3 vs client, per size."""
    threads = args.threads or max(4, os.cpu_count() or 1)  # TensorStore's default
    root = Path(tempfile.mkdtemp(prefix="l3bench-", dir=args.dir))
    rows = []
    try:
        for size in args.sizes:
            rows.append(_bench_size(root / f"s{size}", size, args.total_mib << 20, threads, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print_table(rows, threads, args)
    return {"threads": threads, "file_io_sync": args.file_io_sync, "rows": rows}


def _bench_size(root: Path, size: int, total: int, threads: int, args) -> dict:
    n = max(BATCH, total // size)
    value = np.random.default_rng(size).bytes(size)
    raw_dir, l3_dir, client_dir = root / "raw", root / "l3", root / "client"
    store = TensorStoreL3(str(l3_dir), file_io_concurrency=threads, file_io_sync=args.file_io_sync)
    # Client pages: one array per page of the same byte size (plus a ~100 B header).
    page = {"kv": np.frombuffer(value, np.uint8).view(np.float32)}
    client = StorageClient(
        TensorStoreL3(str(client_dir), file_io_concurrency=threads, file_io_sync=args.file_io_sync),
        Namespace("l3-bench", "float32", 64, 1),
    )
    writes = {
        "raw": lambda names: _raw_write(raw_dir, names, value, threads, args.file_io_sync),
        "l3": lambda names: _l3_write(store, names, value),
        "client": lambda names: (
            client.write_async([(k, page) for k in names]),
            client.flush(),
        ),
    }
    reads = {
        "raw": lambda names: _raw_read(raw_dir, names, size, threads),
        "l3": lambda names: _l3_read(store, names),
        "client": lambda names: len(client.prefetch(names).result()) * size,
    }
    gb = n * size / 1e9
    row: dict = {"value_bytes": size, "pages": n, "fadvise": False}
    samples: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        # Fresh names and empty folders every repeat, so every write creates new files.
        names = [f"{rep:02d}{i:062x}.kv" for i in range(n)]
        shutil.rmtree(raw_dir, ignore_errors=True)
        raw_dir.mkdir(parents=True)
        store.clear()
        client.clear()
        # Alternate the order: other work on the machine and write-back of the previous
        # step should not always hit the same contender.
        order = list(writes) if rep % 2 == 0 else list(reversed(writes))
        for kind in order:
            dt, _ = _timed(writes[kind], names)
            samples.setdefault(f"{kind}_write", []).append(gb / dt)
        files = {"raw": _files(raw_dir), "l3": _files(l3_dir), "client": _files(client_dir)}
        for kind in order:
            row["fadvise"] = _evict(files[kind])
            share = _resident_share(files[kind])
            if share is not None:
                key = f"{kind}_resident_before_cold"
                row[key] = max(row.get(key, 0.0), share)
            dt, nbytes = _timed(reads[kind], names)
            assert nbytes == n * size, (kind, nbytes, n * size)
            samples.setdefault(f"{kind}_read_cold", []).append(gb / dt)
        for kind in order:
            reads[kind](names)  # warm up
            dt, _ = _timed(reads[kind], names)
            samples.setdefault(f"{kind}_read_warm", []).append(gb / dt)
    row.update({k: float(np.median(v)) for k, v in samples.items()})
    row["samples"] = samples
    client.close()
    store.close()
    return row


def _print_table(rows: list[dict], threads: int, args) -> None:
    print(
        f"\nL3 bandwidth (GB/s), TensorStore file backend vs raw files, {threads} threads, "
        f"file_io_sync={args.file_io_sync}, median of {args.repeats}"
    )
    head = f"{'value':>9} {'pages':>6}  {'op':<10} {'raw':>7} {'L3':>7} {'L3/raw':>7} "
    print(head + f"{'client':>7} {'client/raw':>10}")
    for r in rows:
        for op, suffix in (("write", "_write"), ("read cold", "_read_cold"), ("read warm", "_read_warm")):
            raw, l3, cl = r["raw" + suffix], r["l3" + suffix], r["client" + suffix]
            print(
                f"{_size(r['value_bytes']):>9} {r['pages']:>6}  {op:<10} {raw:7.2f} {l3:7.2f} "
                f"{l3 / raw:7.2f} {cl:7.2f} {cl / raw:10.2f}"
            )
        res = [f"{k}={r.get(k + '_resident_before_cold', float('nan')):.0%}" for k in ("raw", "l3", "client")]
        print(
            f"{'':>18}cold: fadvise(DONTNEED)={r['fadvise']}, resident before read "
            f"(fincore, max): {', '.join(res)}"
        )


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * mult)


# Sections run by main(), in order; the engine TTFT section joins here.
def bench_ttft(args: argparse.Namespace) -> dict:
    """TTFT of a long prompt served from L3 after a flush, against its cold prefill and
    against the floor of an L3 hit.

    Per prompt: a cold prefill; an L1 hit (the same prompt again); then, after a flush, an
    L3 hit with the prompt's page files in the OS page cache (``l3_warm``) and one with them
    dropped from it (``l3_dropped``, ``posix_fadvise(DONTNEED)`` after a sync). The floor of
    the dropped hit is the L1 hit's TTFT plus the time the disk takes to read those files
    with plain threads, dropped the same way (``raw_read_s``). A warm-up prompt goes through
    the same passes first, so every program they need is compiled before anything is timed."""
    from hicache_jax.config import EngineConfig
    from hicache_jax.engine.engine import Engine

    spec = Path(args.dir or tempfile.mkdtemp(prefix="hicache_ttft_")) / "l3"
    shutil.rmtree(spec, ignore_errors=True)
    engine = Engine(
        EngineConfig(
            preset=args.ttft_preset,
            page_size=64,
            chunked_prefill_size=1024,
            max_running_requests=4,
            max_total_tokens=4 * args.ttft_tokens,
            enable_hierarchical_cache=True,
            hicache_storage_backend="tensorstore",
            hicache_storage_spec=str(spec),
            hicache_storage_prefetch_policy="wait_complete",
        )
    )

    def ttft(ids):
        rid = engine.add_request(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        while engine.has_unfinished():
            engine.step()
        meta = engine.pop_output(rid)["meta_info"]
        return meta["ttft"], meta["cached_tokens_details"]

    rng = np.random.RandomState(0)
    out = {}
    for _ in ("warmup", "measured"):  # the first pass only compiles
        before = set(_files(spec)) if spec.exists() else set()
        ids = rng.randint(3, engine.model.cfg.vocab_size, args.ttft_tokens).tolist()
        cold, _ = ttft(ids)
        l1, _ = ttft(ids)
        assert engine.flush_cache().success  # drains the L3 writes
        mine = sorted(set(_files(spec)) - before)  # this prompt's page files
        warm, details = ttft(ids)
        assert engine.flush_cache().success
        dropped_ok = _evict(mine)
        resident = _resident_share(mine)
        dropped, details = ttft(ids)
        assert engine.flush_cache().success
        _evict(mine)
        t0 = time.perf_counter()
        nbytes = _raw_read(
            spec, [str(p.relative_to(spec)) for p in mine], max(p.stat().st_size for p in mine), 16
        )
        raw = time.perf_counter() - t0
        floor = l1 + raw
        out = {
            "cold_s": cold,
            "l1_s": l1,
            "l3_warm_s": warm,
            "l3_dropped_s": dropped,
            "raw_read_s": raw,
            "bytes": nbytes,
            "floor_s": floor,
            "ratio_to_floor": dropped / floor,
            "ratio_to_cold": dropped / cold,
            "fadvise": dropped_ok,
            "resident_before_read": resident,
            "cached": details,
        }
    print(
        f"TTFT {args.ttft_tokens} tokens ({args.ttft_preset}): cold {out['cold_s']:.3f}s, L1 hit "
        f"{out['l1_s']:.3f}s, L3 hit (files cached) {out['l3_warm_s']:.3f}s, L3 hit (files dropped) "
        f"{out['l3_dropped_s']:.3f}s\n  floor = L1 hit + raw read of {out['bytes'] / 2**20:.1f} MiB "
        f"({out['raw_read_s']:.3f}s) = {out['floor_s']:.3f}s; dropped/floor {out['ratio_to_floor']:.2f} "
        f"(target <= 1.5); dropped/cold {out['ratio_to_cold']:.3f}; fadvise={out['fadvise']}, "
        f"resident before the read {out['resident_before_read']}; cached {out['cached']}"
    )
    engine.close()
    return out


SECTIONS: dict[str, Callable[[argparse.Namespace], dict]] = {"storage": bench_storage, "ttft": bench_ttft}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes",
        default="64K,1536K",
        type=lambda s: [_parse_size(x) for x in s.split(",")],
        help="page value sizes: 64-token pages of a tiny model and of a ~100M model",
    )
    parser.add_argument("--total_mib", type=int, default=256, help="bytes per size and path")
    parser.add_argument("--threads", type=int, default=0, help="0: TensorStore's default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--file_io_sync", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--dir", default=None, help="where the files go (default: temp dir)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--ttft_preset", default="100m")
    parser.add_argument("--ttft_tokens", type=int, default=4096)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    results = {name: SECTIONS[name](args) for name in args.sections.split(",")}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
