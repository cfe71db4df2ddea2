"""Soak benchmark: several hundred requests from 16+ concurrent HTTP clients against a real
server with every tier on and a pool small enough to force eviction and retraction.

    python benchmarks/soak.py [--rounds 4] [--requests 100] [--clients 16] [--preset tiny]

Prints requests/s, p50/p99 latency and the server's RSS after each round, and fails (exit
1) on any error, any output that differs from the same request run alone, any page left
after flush_cache, or RSS growth past the bound after the first round.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from hicache_jax.bench.server_process import ServerProcess
from hicache_jax.bench.soak import SoakConfig, run_soak, server_flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=100, help="per round")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--pool_tokens", type=int, default=1024, help="device KV pool (forces eviction)")
    ap.add_argument("--max_running", type=int, default=8)
    ap.add_argument("--max_prompt", type=int, default=400)
    ap.add_argument("--rss_bound_mb", type=float, default=64.0, help="allowed RSS growth after round 1")
    args = ap.parse_args()
    cfg = SoakConfig(
        clients=args.clients, rounds=args.rounds, requests_per_round=args.requests, max_prompt=args.max_prompt
    )
    with tempfile.TemporaryDirectory() as tmp:
        flags = server_flags(args.preset, os.path.join(tmp, "l3"), args.pool_tokens, args.max_running)
        with ServerProcess(flags, log_path=os.path.join(tmp, "server.log")) as server:
            report = run_soak(server.url, cfg, rss=server.rss_bytes)
            print(report.summary())
            problems = report.problems(rss_growth_mb=args.rss_bound_mb)
            for p in problems[:50]:
                print("PROBLEM:", p)
            if problems:
                print(server.log_tail(60))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
