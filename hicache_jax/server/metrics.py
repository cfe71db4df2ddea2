"""``GET /metrics``: the engine's numbers in Prometheus' text format.

Every key of ``Engine.metrics()`` (plus the engine loop's own) is exported as
``hicache_<key>``, so numbers the engine grows later (L3 bytes, prefetch outcomes, ...)
appear without a server change. Each is a counter or a gauge as its producer declared it
(``hicache_jax/metric_kinds.py``); a key nobody declared is exported untyped, with a
warning naming it, never guessed (and ``tests/server/test_metrics.py`` fails on it). Hit rates
per tier are derived here. The ``histograms`` entry (``latency.py``: TTFT, TPOT, e2e) becomes
Prometheus histograms. The ``sglang:*`` families an SGLang dashboard queries come from the
same snapshot (``sglang_metrics.py``; ``sglang_histograms`` is exported only there).
"""

from __future__ import annotations

import logging
import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    UnknownMetricFamily,
)

from hicache_jax.metric_kinds import COUNTER, GAUGE, Metrics
from hicache_jax.server import sglang_metrics
from hicache_jax.tiers import TIERS

log = logging.getLogger(__name__)

PREFIX = "hicache_"
HELP = {
    "gen_throughput": "generated tokens per second over the last 10 s",
    "num_running_reqs": "requests in the running batch",
    "num_waiting_reqs": "requests in the queue",
    "cached_tokens": "prompt tokens served from the cache (all tiers)",
    "cache_hit_rate": "cached_tokens / prompt_tokens since start",
}


def _name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class _Snapshot:
    """A one-scrape collector over a metrics dict."""

    def __init__(self, metrics: Metrics, model_name: str):
        self.metrics = metrics
        self.model_name = model_name

    def collect(self):
        m = self.metrics
        for key, value in sorted(m.items()):
            if key == "sglang_histograms":
                continue  # TTFT / e2e again, with SGLang's bounds: sglang:* only
            doc = HELP.get(key, key.replace("_", " "))
            kind = m.kinds.get(key)
            if kind == COUNTER:
                yield CounterMetricFamily(_name(key.removesuffix("_total")), doc, value=value)
            elif kind == GAUGE:
                yield GaugeMetricFamily(_name(key), doc, value=value)
            elif kind is None:
                yield UnknownMetricFamily(_name(key), doc, value=value)
            else:
                yield from _histograms(value)
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
        yield from sglang_metrics.collect(m, self.model_name)


def _histograms(snapshots: dict):
    """One Prometheus histogram per ``latency.Histogram.snapshot()``, by name."""
    for key, h in sorted(snapshots.items()):
        buckets = [(le if le == "+Inf" else repr(float(le)), n) for le, n in h["buckets"]]
        yield HistogramMetricFamily(_name(key), key.replace("_", " "), buckets=buckets, sum_value=h["sum"])


_warned: set[str] = set()


def render(metrics: Metrics, model_name: str = "") -> bytes:
    """The Prometheus text of ``metrics``; a key without a declared kind goes out untyped,
    and is named in a warning once per process. ``model_name`` labels the sglang:* families."""
    if not isinstance(metrics, Metrics):
        metrics = Metrics().add(metrics)
    new = [k for k in metrics.undeclared() if k not in _warned]
    if new:
        _warned.update(new)
        log.warning("metrics without a declared kind (exported untyped): %s", new)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metrics, model_name))
    return generate_latest(registry)
