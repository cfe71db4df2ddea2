"""What the L2 backup and the L3 write path cost when they buy nothing: L1 against L1+L2+L3
on a workload that fits the device pool, side by side in one run.

    python benchmarks/write_path.py [--server_flags "..."] [--repeats 3] [--out_dir DIR]

Two servers run at once from the same flags (default: ``configs/cpu.flags --preset=100m``),
one with the radix cache alone, one with ``--enable_hierarchical_cache`` and a TensorStore
L3 (write-through: every page the tree takes is copied to the host and queued for L3).
After a warm-up pass on each (other tokens: compiles out of the numbers), the same
saturating multi-turn chat (every client at once, no think time) runs ``--repeats`` times
on each, in alternating order (A B, B A, ...), caches emptied before each run, so drift on a
shared machine falls on both alike. Every hit must come from the device, so any difference
is the write path's.

Also reported, per server over its measured runs: CPU seconds by thread (from
``/proc/PID/task``): XLA's compute threads, the Python threads (the engine and HTTP loops
and the L3 planning and writer threads share the process name), TensorStore's I/O pool.
That is where the write path's work would show: on this box host threads take the cores
the "device" computes on.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shlex
import statistics
import sys

import httpx

from hicache_jax.bench import report
from hicache_jax.bench.client import BenchClient, fetch_info
from hicache_jax.bench.server_process import REPO_CONFIGS, ServerProcess
from hicache_jax.bench.workloads import ChatConfig, multi_turn

GOAL = 0.95  # L1+L2+L3 throughput over L1's, at least


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of process ``pid`` (threads alive now)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: collections.Counter = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(server: ServerProcess, chat: ChatConfig, seed: int, storage: bool) -> dict:
    with httpx.Client(base_url=server.url, timeout=600) as c:
        c.post("/flush_cache").raise_for_status()
        if storage:
            c.post("/clear_storage").raise_for_status()
    info = fetch_info(server.url)

    async def drive():
        client = BenchClient(server.url, timeout_s=1800)
        try:
            return await multi_turn(client, chat, info.vocab_size, seed), client.now()
        finally:
            await client.aclose()

    records, seconds = asyncio.run(drive())
    return report.summarize("run", records, seconds, info)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--server_flags", default=f"--flagfile={os.path.join(REPO_CONFIGS, 'cpu.flags')} --preset=100m"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out_dir", default="write-path-out")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--system_tokens", type=int, default=512)
    ap.add_argument("--user_tokens", type=int, default=64)
    ap.add_argument("--output_tokens", type=int, default=16)
    a = ap.parse_args()
    chat = ChatConfig(
        clients=a.clients,
        rounds=a.rounds,
        system_tokens=a.system_tokens,
        user_tokens=a.user_tokens,
        output_tokens=a.output_tokens,
        arrival_rate=1000.0,
        think_s=0.0,
    )
    os.makedirs(a.out_dir, exist_ok=True)
    base = shlex.split(a.server_flags)
    l3 = os.path.join(os.path.abspath(a.out_dir), "l3")
    configs = {
        "L1": (base, False),
        "L1+L2+L3": (
            base
            + [
                "--enable_hierarchical_cache",
                "--hicache_write_policy=write_through",
                "--hicache_storage_backend=tensorstore",
                f"--hicache_storage_spec={l3}",
            ],
            True,
        ),
    }
    servers = {}
    try:
        for name, (flags, _) in configs.items():
            log = os.path.join(a.out_dir, f"{name.replace('+', '_')}.log")
            servers[name] = ServerProcess(flags, log_path=log, startup_timeout=1800)
        pool = fetch_info(servers["L1"].url).device_tokens
        need = chat.distinct_tokens(chat.clients)
        print(
            f"workload: {chat.num_requests} requests, {need:,} distinct tokens; device pool {pool:,} tokens"
        )
        if pool is not None and need > pool:
            sys.exit(
                f"the workload ({need} tokens) does not fit the device pool ({pool}): not this benchmark"
            )
        for name, server in servers.items():  # compiles, on other tokens
            run_once(server, chat, seed=7919, storage=configs[name][1])
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        cpu = {name: collections.Counter() for name in servers}
        total_cpu = dict.fromkeys(servers, 0.0)
        names = list(servers)
        for r in range(a.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                server = servers[name]
                before, t0 = thread_cpu(server.pid), process_cpu(server.pid)
                s = run_once(server, chat, seed=0, storage=configs[name][1])
                after = thread_cpu(server.pid)
                total_cpu[name] += process_cpu(server.pid) - t0
                cpu[name].update({k: v - before.get(k, 0.0) for k, v in after.items()})
                runs[name].append(s)
                tiers = s["cached_tokens_per_tier"]
                print(
                    f"repeat {r}  {name:9s} in {s['input_tok_s']:8.0f} tok/s  TTFT p50 "
                    f"{s['ttft_ms']['p50']:7.0f} ms  TPOT p50 {s['tpot_ms']['p50']:6.1f} ms  "
                    f"cached device/host/storage {tiers['device']}/{tiers['host']}/{tiers['storage']}",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.close()
    print()
    tput = {name: [s["input_tok_s"] for s in v] for name, v in runs.items()}
    for name in names:
        med = statistics.median(tput[name])
        print(f"{name:9s} input tok/s per run {[round(x) for x in tput[name]]}  median {med:.0f}")
    paired = [b / a_ for a_, b in zip(tput["L1"], tput["L1+L2+L3"], strict=True)]
    ratio = sum(tput["L1+L2+L3"]) / sum(tput["L1"])
    per = [round(x, 3) for x in paired]
    print(f"L1+L2+L3 / L1: {ratio:.3f} over all runs; per repeat {per}; goal >= {GOAL}")
    for name in names:
        top = ", ".join(f"{k} {v:.1f}" for k, v in cpu[name].most_common(4) if v >= 0.05)
        print(f"{name:9s} CPU seconds in its measured runs: {total_cpu[name]:.1f} ({top})")


if __name__ == "__main__":
    main()
