"""``GET /metrics``: the engine's numbers in Prometheus' text format.

Every numeric key of ``Engine.metrics()`` (plus the engine loop's own) is exported as
``hicache_<key>``, so counters the engine grows later (L3 bytes, prefetch outcomes, ...)
appear without a server change. Keys known to only grow, any ending in ``_total`` and the L3 and
prefetch event counts are counters; the rest are gauges. Hit rates per tier are derived here.
The ``histograms`` entry (``latency.py``: TTFT, TPOT, e2e) becomes Prometheus histograms.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "hicache_"
TIERS = ("device", "host", "storage")
COUNTERS = {
    "steps",
    "requests_finished",
    "prompt_tokens",
    "generated_tokens",
    "cached_tokens",
    "cached_tokens_device",
    "cached_tokens_host",
    "cached_tokens_storage",
    "num_retractions",
    "aborted_requests",
    "engine_errors",
    "host_loads",
    "host_backups",
    "backup_skipped",
}
HELP = {
    "gen_throughput": "generated tokens per second over the last 10 s",
    "num_running_reqs": "requests in the running batch",
    "num_waiting_reqs": "requests in the queue",
    "cached_tokens": "prompt tokens served from the cache (all tiers)",
    "cache_hit_rate": "cached_tokens / prompt_tokens since start",
}


def _name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


GAUGE_WORDS = ("pending", "used", "size", "in_flight", "inflight", "rate", "throughput")


def is_counter(key: str) -> bool:
    """Known counters, ``*_total``, and L3/prefetch event counts (not their gauges)."""
    if key in COUNTERS or key.endswith("_total"):
        return True
    return key.startswith(("l3_", "prefetch_")) and not any(w in key for w in GAUGE_WORDS)


class _Snapshot:
    """A one-scrape collector over a metrics dict."""

    def __init__(self, metrics: dict):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        for key, value in sorted(m.items()):
            if not isinstance(value, (int, float)):
                continue
            doc = HELP.get(key, key.replace("_", " "))
            if is_counter(key):
                yield CounterMetricFamily(_name(key.removesuffix("_total")), doc, value=value)
            else:
                yield GaugeMetricFamily(_name(key), doc, value=value)
        prompt = m.get("prompt_tokens", 0)
        yield GaugeMetricFamily(
            _name("cache_hit_rate"), HELP["cache_hit_rate"], value=m.get("cached_tokens", 0) / max(prompt, 1)
        )
        tiers = GaugeMetricFamily(
            _name("cache_tier_hit_rate"), "cached_tokens_<tier> / prompt_tokens since start", labels=["tier"]
        )
        for tier in TIERS:
            tiers.add_metric([tier], m.get(f"cached_tokens_{tier}", 0) / max(prompt, 1))
        yield tiers
        for key, h in sorted(m.get("histograms", {}).items()):
            buckets = [(le if le == "+Inf" else repr(float(le)), n) for le, n in h["buckets"]]
            doc = key.replace("_", " ")
            yield HistogramMetricFamily(_name(key), doc, buckets=buckets, sum_value=h["sum"])


def render(metrics: dict) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metrics))
    return generate_latest(registry)
