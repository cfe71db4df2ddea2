"""The field bug: with the S3 store behind L3 stopped while the server runs, every request
waited past 120 s and /flush_cache never answered. A real server on a real S3 store
(SeaweedFS), killed mid-run: requests complete promptly without L3, /flush_cache answers
within its deadline and says what it did, /metrics shows why."""

from __future__ import annotations

import json
import time

import numpy as np

from tests.reliability.weed import Weed, require_weed
from tests.server.conftest import PAGE_SIZE

TIMEOUT = 1.0  # --hicache_storage_timeout_s
MARGIN = 3.0  # a request's own compute on a busy 2-core machine
GEN4 = {"max_new_tokens": 4, "temperature": 0}


def _ids(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=16 * PAGE_SIZE).tolist()


def _timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def test_s3_outage_serves_without_l3_and_flush_answers(start_server, tmp_path, monkeypatch):
    require_weed()  # fails, never skips, without SeaweedFS
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "hicache-test")  # any key: weed runs without auth
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hicache-test")
    weed = Weed(str(tmp_path / "weed"))
    try:
        spec = json.dumps(weed.spec, separators=(",", ":"))
        server = start_server(spec, f"--hicache_storage_timeout_s={TIMEOUT}")
        ids = _ids(1)
        first = server.generate(input_ids=ids, sampling_params=GEN4)
        flushed = server.client.post("/flush_cache").json()
        assert flushed["success"] and flushed["l3"]["complete"], flushed
        second = server.generate(input_ids=ids, sampling_params=GEN4)
        assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - PAGE_SIZE  # S3 works
        assert second["output_ids"] == first["output_ids"]
        assert server.client.post("/flush_cache").json()["success"]

        weed.kill()
        for seed in (1, 2, 3, 4, 5):
            out, took = _timed(server.generate, input_ids=_ids(seed), sampling_params=GEN4)
            # wait_complete: the prefetch's probe gives up after one deadline, then a miss;
            # after 3 such failures the read breaker is open and L3 is not even asked.
            assert took < (TIMEOUT + MARGIN if seed <= 3 else TIMEOUT), (seed, took)
            assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
            if seed == 1:
                assert out["output_ids"] == first["output_ids"]
        r, took = _timed(server.client.post, "/flush_cache")
        assert r.status_code == 200 and took < TIMEOUT + MARGIN, (took, r.text)
        report = r.json()
        assert report["success"] and "l3" in report, report
        m = server.metrics()
        assert m["hicache_l3_timeouts_total"] >= 3, m  # why L3 was skipped
        assert (
            m["hicache_storage_read_breaker_open"] == 1 and m["hicache_prefetch_skipped_l3_down_total"] >= 2
        )
        assert "hicache_l3_pending_write_bytes" in m
        assert server.healthy()
    finally:
        weed.kill()
