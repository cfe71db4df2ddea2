"""The Grafana dashboard in ``examples/monitoring`` queries only metrics that the server
exports: every metric name in its PromQL expressions appears in the shared server's
``/metrics``, and the Prometheus config scrapes that path."""

from __future__ import annotations

import json
import os
import re

import yaml

from tests.server.conftest import ROOT

MONITORING = os.path.join(ROOT, "examples", "monitoring")
# A metric name in PromQL: an identifier not followed by "(" (a function), not a label
# (inside {...}), not a keyword, not a Grafana variable ($__rate_interval, $instance).
KEYWORDS = {"sum", "by", "le", "rate", "clamp_min", "histogram_quantile", "max", "without", "on"}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range windows
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables
    expr = re.sub(r"\bby\s*\([^)]*\)", "", expr)  # grouping labels
    names = set(re.findall(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:]|\s*\()", expr))
    return names - KEYWORDS


def _exported(text: str) -> set[str]:
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {line.split("{")[0].split(" ")[0] for line in samples}


def test_metric_names_parse():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(hicache_a_bucket{instance=~"$x"}[$__rate_interval])))'
    assert _metric_names(expr) == {"hicache_a_bucket"}
    assert _metric_names('sum(hicache_b{i=~"$i"}) / sum(hicache_c)') == {"hicache_b", "hicache_c"}


def test_dashboard_queries_exported_metrics(server):
    with open(os.path.join(MONITORING, "grafana_dashboard.json")) as f:
        dash = json.load(f)
    r = server.client.get("/metrics")
    assert r.status_code == 200
    exported = _exported(r.text)
    queried: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            queried |= names
    assert queried - exported == set(), f"the dashboard queries metrics /metrics lacks: {queried - exported}"
    for family in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert f"hicache_{family}_bucket" in queried  # TTFT / TPOT as real histograms


def test_prometheus_config_scrapes_metrics():
    with open(os.path.join(MONITORING, "prometheus.yml")) as f:
        cfg = yaml.safe_load(f)
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"]


def test_latency_histograms_count_requests(server):
    names = [f"hicache_{h}_count" for h in ("time_to_first_token_seconds", "time_per_output_token_seconds")]
    before = server.metrics()
    server.generate(
        text="histogram", sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    )
    after = server.metrics()
    for name in names:
        assert after[name] >= before[name] + 1, name
    assert (
        after["hicache_time_to_first_token_seconds_sum"] > before["hicache_time_to_first_token_seconds_sum"]
    )
