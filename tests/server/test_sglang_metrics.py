"""The sglang:* families beside the hicache_* ones: after a few requests, one scrape of the
shared server's /metrics has each with SGLang's type and ``model_name`` label, and the value
of the hicache_* number it mirrors (histograms: the same count and sum, SGLang's buckets)."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from hicache_jax.server import sglang_metrics
from hicache_jax.server.latency import SGLANG_E2E_BUCKETS, SGLANG_TTFT_BUCKETS

# sglang family -> (type, our family)
MIRRORED = {
    **{name: ("counter", f"hicache_{key}") for name, (key, _) in sglang_metrics.COUNTERS.items()},
    **{name: ("gauge", f"hicache_{key}") for name, (key, _) in sglang_metrics.GAUGES.items()},
    "sglang:cache_hit_rate": ("gauge", "hicache_cache_hit_rate"),
    **{name: ("histogram", f"hicache_{ours}") for name, ours in sglang_metrics.HISTOGRAMS.items()},
}


def _scrape(server) -> dict:
    r = server.client.get("/metrics")
    assert r.status_code == 200, r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _value(family, suffix: str = "") -> float:
    (sample,) = [s for s in family.samples if s.name == family.name + suffix]
    return sample.value


def test_sglang_families_mirror_ours(server):
    for i in range(2):
        server.generate(
            text=f"sglang metric names {i}", sampling_params={"max_new_tokens": 3, "temperature": 0}
        )
    deadline = time.monotonic() + 30
    while True:  # idle, so the gauges and counters do not move between the two families
        families = _scrape(server)
        if _value(families["hicache_num_running_reqs"]) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    model = server.client.get("/v1/models").json()["data"][0]["id"]
    for name, (kind, ours) in MIRRORED.items():
        fam = families.get(name)
        assert fam is not None, f"{name} missing"
        assert fam.type == kind, (name, fam.type)
        assert all(s.labels.get("model_name") == model for s in fam.samples), name
        if kind == "counter":
            assert _value(fam, "_total") == _value(families[ours], "_total"), name
        elif kind == "gauge":
            assert _value(fam) == _value(families[ours]), name
        else:
            mine = [s for s in fam.samples if s.name.endswith("_bucket")]
            bounds = SGLANG_TTFT_BUCKETS if "first_token" in name else SGLANG_E2E_BUCKETS
            assert [float(s.labels["le"]) for s in mine] == [*map(float, bounds), float("inf")], name
            assert _value(fam, "_count") == _value(families[ours], "_count") >= 2, name
            assert abs(_value(fam, "_sum") - _value(families[ours], "_sum")) < 1e-9, name
    assert _value(families["sglang:prompt_tokens"], "_total") > 0
    assert _value(families["sglang:generation_tokens"], "_total") >= 6
