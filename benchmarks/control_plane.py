"""Control-plane cost per step against the size of the cache: scheduler plus prefix cache,
no model.

    python benchmarks/control_plane.py [--sizes 1000,100000,1000000] [--steps 200]

The Scheduler, CacheAdapter and PrefixCache (with an L2 host tier, write-through) run as
the engine drives them; the model step is faked (every sampled token is drawn at random).
256 requests run at once; as one finishes a new one arrives (a quarter of them revisit an
older prompt, so matches hit device and host pages and load them back). The device pool
holds the running requests plus 1024 pages of cache and the host pool ``size`` pages; both
are filled with cached prompts first, so every step evicts on both tiers. The tree then
holds about ``size`` + the device pool's pages.

Reported per size: tree nodes, then milliseconds per step for schedule + postprocess + host
backups (wall mean, p90 and max; mean CPU time of this process, which other load on the
machine disturbs less) and the wall ratio to the first size. The goal: flat, i.e. the
per-step cost depends on the step's work, not on how many pages are cached.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import resource
import statistics
import sys
import time

import numpy as np

from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix import PrefixRules
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.config import EngineConfig
from hicache_jax.kinds import CacheKind
from hicache_jax.request import Req
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler.cache_adapter import CacheAdapter
from hicache_jax.scheduler.scheduler import Scheduler

P = 16
LAYOUT = {"kv": ((1,), np.uint8)}  # one byte per host row: the bookkeeping is what is timed


class FakeTransfer:
    """Device <-> host copies that move nothing."""

    def read(self, kind, idx):
        return {"kv": np.zeros((len(idx), 1), np.uint8)}

    def write(self, kind, idx, arrays):
        pass


class Workload:
    """Prompts: one of 64 shared system prefixes, then unique pages; some revisit an old
    prompt (all of its pages may still be cached)."""

    def __init__(self, rng: np.random.Generator, prompt_pages: int, shared_pages: int):
        self.rng = rng
        self.prompt_pages = prompt_pages
        self.shared_pages = shared_pages
        self.systems = [rng.integers(3, 50000, shared_pages * P).tolist() for _ in range(64)]
        self.history: list[np.ndarray] = []  # compact: a million-page tree has many

    def fresh(self) -> list[int]:
        sys_ = self.systems[int(self.rng.integers(len(self.systems)))]
        tail = self.rng.integers(3, 50000, (self.prompt_pages - self.shared_pages) * P + 1).tolist()
        return sys_ + tail

    def prompt(self) -> list[int]:
        if self.history and self.rng.random() < 0.25:
            return self.history[int(self.rng.integers(len(self.history)))].tolist()
        tokens = self.fresh()
        self.history.append(np.asarray(tokens, np.int32))
        return tokens


def populate(cache: PrefixCache, work: Workload) -> None:
    """Fill both pools with cached prompts: the device pool with pages that have no host
    copy yet, then the host pool with host-only pages (prompts that ran long ago)."""
    n = work.prompt_pages
    while cache.pools["full"].num_free >= n:
        tokens = work.fresh()
        work.history.append(np.asarray(tokens, np.int32))
        idx = cache.pools["full"].alloc(n)
        _, taken = cache.insert(tokens, None, n, {"full": idx})
        cache.pools["full"].free([p for j, p in enumerate(idx) if j not in taken["full"]])
    cache.write_policy.clear()  # (a host-sized backup here would only evict host rows)
    row = {"full": {"kv": np.zeros((1,), np.uint8)}}
    while cache.host["full"].index.num_free:
        tokens = work.fresh()
        work.history.append(np.asarray(tokens, np.int32))
        cache.insert_host(tokens, None, {j: row for j in range(n)}, [b"h"] * n, n)


def count_nodes(cache: PrefixCache) -> int:
    return sum(1 for _ in cache.nodes())


def run(size: int, steps: int, warmup: int, running: int, seed: int, profile: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    prompt_pages, shared_pages, out_lo, out_hi = 32, 16, 128, 384
    # Room for the running requests (prompt + output on average) and 1024 pages of cache.
    device_pages = running * (prompt_pages + (out_lo + out_hi) // 2 // P) + 1024
    cfg = EngineConfig(
        page_size=P,
        chunked_prefill_size=4096,
        max_running_requests=running,
        max_total_tokens=device_pages * P,
        enable_hierarchical_cache=True,
    )
    rules = PrefixRules(page_size=P, kinds=(CacheKind.FULL,))
    pools = {"full": IndexPool(device_pages, "full-attention pages")}
    host = {"full": HostPool("full", size, LAYOUT)}
    cache = PrefixCache(rules, pools, host=host, transfer=FakeTransfer(), write_policy="write_through")
    adapter = CacheAdapter(cache)
    sched = Scheduler(cfg, adapter)
    work = Workload(rng, prompt_pages, shared_pages)
    t0 = time.perf_counter()
    populate(cache, work)
    fill_s = time.perf_counter() - t0
    sampling = [
        SamplingParams(max_new_tokens=int(m), ignore_eos=True) for m in rng.integers(out_lo, out_hi, 4096)
    ]
    made = 0

    def arrive() -> None:
        nonlocal made
        tokens = work.prompt()
        sched.add(Req(rid=str(made), input_ids=tokens, sampling=sampling[made % len(sampling)]))
        made += 1

    for _ in range(running + 8):
        arrive()
    times, cpu = [], []
    prof = cProfile.Profile() if profile else None
    for step in range(warmup + steps):
        if prof is not None and step == warmup:
            prof.enable()
        while len(sched.waiting) < 8:
            arrive()
        toks = rng.integers(3, 50000, 2 * running).tolist()
        t, c = time.perf_counter(), time.process_time()
        plan = sched.schedule()
        for s, item in enumerate(plan.items):  # the engine's postprocess, minus the model
            req = item.req
            req.num_computed = item.end
            if item.samples:
                req.output_ids.append(toks[s])
                if len(req.output_ids) >= req.sampling.max_new_tokens:
                    sched.running.remove(req)
                    adapter.finish(req)
                    continue
            adapter.after_step(req, insert=item.num_tokens > 1 or item.start < req.input_len)
        cache.backup_pending()
        if step >= warmup:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    nodes = count_nodes(cache)
    held = adapter.held(sched.running)
    cache.check_integrity(held)
    ms = [x * 1e3 for x in times]
    return {
        "size": size,
        "nodes": nodes,
        "device_free": pools["full"].num_free,
        "host_free": host["full"].index.num_free,
        "running": len(sched.running),
        "fill_s": fill_s,
        "mean_ms": statistics.fmean(ms),
        "cpu_ms": statistics.fmean(cpu) * 1e3,
        "p90_ms": sorted(ms)[int(0.9 * (len(ms) - 1))],
        "max_ms": max(ms),
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,100000,1000000", help="cached pages (host pool rows)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per size")
    ap.add_argument("--warmup", type=int, default=200, help="untimed steps first (reach steady state)")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="profile the timed steps (cProfile)")
    args = ap.parse_args()
    rows = []
    print(f"python {sys.version.split()[0]}, pid {os.getpid()}", flush=True)
    for size in [int(s) for s in args.sizes.split(",")]:
        gc.collect()
        r = run(size, args.steps, args.warmup, args.running, args.seed, args.profile)
        rows.append(r)
        base = rows[0]["mean_ms"]
        print(
            f"size {r['size']:>8}  nodes {r['nodes']:>8}  running {r['running']}  "
            f"free dev/host {r['device_free']}/{r['host_free']}  fill {r['fill_s']:.1f}s  "
            f"step mean {r['mean_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms  max {r['max_ms']:.1f} ms  "
            f"cpu {r['cpu_ms']:.3f} ms  x{r['mean_ms'] / base:.2f}  "
            f"rss {r['max_rss_gb']:.2f} GB",
            flush=True,
        )


if __name__ == "__main__":
    main()
