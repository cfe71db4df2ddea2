"""A short soak (the long one is ``benchmarks/soak.py``): 16 concurrent HTTP clients on a
real server with L1, L2 and L3 on and a pool small enough to force eviction and retraction;
streaming and not, aborts and disconnects. Every request meant to complete does, with its
solo output; after flush_cache no page is used; the server's RSS stays bounded."""

import os

from hicache_jax.bench.server_process import ServerProcess, metrics
from hicache_jax.bench.soak import SoakConfig, run_soak, server_flags
from tests.server.conftest import server_env


def test_short_soak(tmp_path):
    flags = server_flags("tiny", str(tmp_path / "l3"), pool_tokens=512, max_running=4) + ["--warmup=false"]
    with ServerProcess(flags, log_path=str(tmp_path / "server.log"), env=server_env()) as server:
        cfg = SoakConfig(clients=16, rounds=3, requests_per_round=32, max_prompt=240, max_new_tokens=12)
        report = run_soak(server.url, cfg, rss=server.rss_bytes)
        print(report.summary())
        assert report.problems(rss_growth_mb=64) == [], server.log_tail()
        m = metrics(server.url)
        assert m["hicache_num_retractions_total"] > 0, "the pool was meant to force retraction"
        assert m["hicache_l3_writes_total"] > 0 and m["hicache_host_backups_total"] > 0
        assert sum(o.status == "gave_up" for o in report.outcomes) > 0, "no abort or disconnect was tried"
        assert os.path.exists(tmp_path / "l3")
