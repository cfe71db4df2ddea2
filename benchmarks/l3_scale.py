"""L3 at scale: existence probes, reads, writes and one eviction pass as a store grows to
millions of pages, on the `file` driver and on S3 (a local SeaweedFS).

Pages are small state-sized values (`--value_bytes`, default 256 B) under the fleet layout
(``pages/<namespace>/ab/cd/<hash>.kv``). The store is filled in batches; at each size in
`--sizes` it measures, with the store otherwise idle:

  probe   `exists` of 512 stored + 512 absent keys (per key)
  read    `get` of 512 random stored pages (per page)
  write   `put` of 512 new pages (per page; the fill rate is printed too)
  evict   one eviction pass of 512 pages: choosing the victims in the LRU index (ms per
          pass: numpy over the whole index) and deleting them (per page)

each the median of `--rounds` (9) rounds on fresh random keys.
Each should be flat in the store's size. The closing line gives the probe cost at the
largest size over the smallest (goal: <= 1.5); since a shared machine is noisy, a second
store of the smallest size is also measured round by round beside the growing one, and
the per-round ratios to it are printed too (at equal sizes they show the noise). Writes
a table, a JSON file and a PNG plot.

    python benchmarks/l3_scale.py --stores file,s3 --sizes 10000,100000,1000000 --out /tmp/l3_scale
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hicache_jax.storage.journal import encode_records
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.layout import page_path
from hicache_jax.storage.lru_index import LruIndex
from hicache_jax.storage.tensorstore_store import TensorStoreL3

NS = Namespace("l3-scale-bench", "bfloat16", 16, 1)
PROBES = 1024
FILL_BATCH = 4096


def _keys(rng: np.random.Generator, n: int) -> list[str]:
    return [page_path(NS, h.tobytes(), "kv") for h in rng.integers(0, 256, (n, 32), dtype=np.uint8)]


class Bench:
    def __init__(self, store: TensorStoreL3, value_bytes: int, seed: int = 0):
        self.store = store
        self.value = os.urandom(value_bytes)
        self.rng = np.random.default_rng(seed)
        self.index = LruIndex()
        self.keys: list[str] = []  # every stored key (sampled for probes and reads)
        self.fill_s = 0.0

    def fill_to(self, n: int, log, budget_s: float = float("inf")) -> None:
        while len(self.keys) < n and self.fill_s < budget_s:
            batch = _keys(self.rng, min(FILL_BATCH, n - len(self.keys)))
            t0 = time.perf_counter()
            self.store.put([(k, self.value) for k in batch], force=True)
            self.fill_s += time.perf_counter() - t0
            self.index.fold(encode_records(time.time(), [(k, len(self.value)) for k in batch]))
            self.keys += batch
            if len(self.keys) % (FILL_BATCH * 25) < FILL_BATCH:
                log(f"  {len(self.keys):>9,} pages, fill {len(self.keys) / self.fill_s:,.0f} pages/s")

    def measure(self, ref: Bench, rounds: int = 9) -> dict:
        """Medians over `rounds` rounds, each on fresh random keys, alternating with the same
        round on `ref` (a store of the smallest size): a shared 2-core box is noisy, so the
        growth is read from ratios to `ref` measured side by side, round by round."""
        mine: dict[str, list[float]] = {}
        theirs: dict[str, list[float]] = {}
        for _ in range(rounds):
            for got, bench in ((theirs, ref), (mine, self)):
                for metric, value in bench._round().items():
                    got.setdefault(metric, []).append(value)
        out = {
            "pages": len(self.keys),
            "ref_pages": len(ref.keys),
            "fill_pages_per_s": len(self.keys) / self.fill_s,
        }
        for m, v in mine.items():
            out[m] = float(np.median(v))
            out[f"{m}_vs_ref"] = float(np.median(np.array(v) / np.array(theirs[m])))
        return out

    def _round(self, n: int = PROBES // 2) -> dict:
        out = {}
        present = [self.keys[i] for i in self.rng.choice(len(self.keys), n, replace=False)]
        absent = _keys(self.rng, n)
        t0 = time.perf_counter()
        found = self.store.exists(present + absent)
        out["probe_us"] = 1e6 * (time.perf_counter() - t0) / (2 * n)
        assert found == [True] * n + [False] * n
        picked = [self.keys[i] for i in self.rng.choice(len(self.keys), n, replace=False)]
        t0 = time.perf_counter()
        values = self.store.get(picked)
        out["read_us"] = 1e6 * (time.perf_counter() - t0) / n
        assert all(v == self.value for v in values)
        new = _keys(self.rng, n)
        t0 = time.perf_counter()
        self.store.put([(k, self.value) for k in new], force=True)
        out["write_us"] = 1e6 * (time.perf_counter() - t0) / n
        self.index.fold(encode_records(time.time(), [(k, len(self.value)) for k in new]))
        self.keys += new
        # One eviction pass of n pages: choosing them in the index, then deleting them.
        t0 = time.perf_counter()
        victims = self.index.victims(n * len(self.value))
        paths = self.index.paths(victims)
        self.index.remove(victims)
        out["select_ms"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.store.delete(paths)
        out["delete_us"] = 1e6 * (time.perf_counter() - t0) / len(paths)
        gone = set(paths)
        self.keys = [k for k in self.keys if k not in gone]
        return out


def _open(kind: str, workdir: str, log):
    """(make(name) -> a fresh store, cleanup) for 'file' or 's3' (a SeaweedFS server started here)."""
    if kind == "file":
        make = lambda name: TensorStoreL3(os.path.join(workdir, name), timeout_s=600)  # noqa: E731
        return make, lambda: None
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.reliability.weed import Weed, require_weed

    require_weed()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "hicache-bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "hicache-bench")
    weed = Weed(os.path.join(workdir, "weed"))
    log(f"  SeaweedFS S3 at {weed.endpoint}")
    return lambda name: TensorStoreL3(weed.spec_at(name), timeout_s=600), weed.kill


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("probe_us", "probe_us_vs_ref", "read_us", "write_us", "delete_us", "select_ms")
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.6))
    titles = {"probe_us_vs_ref": "probe / smallest store (side by side)"}
    for ax, metric in zip(axes, metrics):
        for store, rows in results.items():
            ax.plot([r["pages"] for r in rows], [r[metric] for r in rows], "o-", label=store)
        if metric == "probe_us_vs_ref":
            ax.axhline(1.5, color="grey", linestyle="--", linewidth=1)  # the goal
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("pages in store")
        default = metric.replace("_us", " (us per page)").replace("_ms", " (ms per pass)")
        ax.set_title(titles.get(metric, default))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--value_bytes", type=int, default=256)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "l3_scale"))
    ap.add_argument("--rounds", type=int, default=9, help="measurement rounds per size (medians)")
    ap.add_argument("--fill_budget_s", type=float, default=1200, help="per store: stop growing past this")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    results: dict[str, list[dict]] = {}
    for kind in args.stores.split(","):
        workdir = tempfile.mkdtemp(prefix=f"l3scale-{kind}-", dir=args.dir)
        make, cleanup = _open(kind, workdir, log)
        ref, bench = Bench(make("ref"), args.value_bytes, seed=1), Bench(make("big"), args.value_bytes)
        try:
            ref.fill_to(sizes[0], log)
            for n in sizes:
                if bench.fill_s > args.fill_budget_s:
                    break
                bench.fill_to(n, log, args.fill_budget_s)
                if len(bench.keys) < n:
                    log(
                        f"{kind}: fill budget ({args.fill_budget_s:.0f} s) spent at {len(bench.keys):,} pages"
                    )
                row = bench.measure(ref, args.rounds)
                log(f"{kind} {json.dumps({k: round(v, 2) for k, v in row.items()})}")
                results.setdefault(kind, []).append(row)
                with open(os.path.join(args.out, "l3_scale.json"), "w") as f:
                    json.dump({"value_bytes": args.value_bytes, "results": results}, f, indent=1)
        finally:
            ref.store.close()
            bench.store.close()
            cleanup()
            log(f"  removing {workdir}")
            subprocess.run(["rm", "-rf", workdir], check=False)  # much faster than shutil at 1M files
    head = f"{'store':<6} {'pages':>10} {'probe us':>9} {'read us':>8} {'write us':>9}"
    print(f"\n{head} {'delete us':>10} {'select ms':>10} {'fill/s':>8} {'probe/ref':>10}")
    for kind, rows in results.items():
        for r in rows:
            print(
                f"{kind:<6} {r['pages']:>10,} {r['probe_us']:>9.1f} {r['read_us']:>8.1f}"
                f" {r['write_us']:>9.1f} {r['delete_us']:>10.1f} {r['select_ms']:>10.1f}"
                f" {r['fill_pages_per_s']:>8.0f} {r['probe_us_vs_ref']:>10.2f}"
            )
        first, last = rows[0], rows[-1]
        print(
            f"{kind}: probe cost at {last['pages']:,} / at {first['pages']:,} pages ="
            f" {last['probe_us'] / first['probe_us']:.2f} (medians); side by side with the"
            f" {last['ref_pages']:,}-page store: probe {last['probe_us_vs_ref']:.2f},"
            f" read {last['read_us_vs_ref']:.2f}, write {last['write_us_vs_ref']:.2f},"
            f" delete {last['delete_us_vs_ref']:.2f}"
        )
    _plot(results, os.path.join(args.out, "l3_scale.png"))
    print(f"plot: {os.path.join(args.out, 'l3_scale.png')}")


if __name__ == "__main__":
    main()
