"""The ``sglang:*`` families an SGLang dashboard queries, beside our ``hicache_*`` ones.

Always exported (a dozen families per scrape, no flag). Each is one of our numbers under
SGLang's name, type and ``model_name`` label, and only where the meaning is the same:

    sglang:prompt_tokens_total        counter    <- prompt_tokens (added as a request finishes)
    sglang:generation_tokens_total    counter    <- generated_tokens
    sglang:cached_tokens_total        counter    <- cached_tokens (all tiers)
    sglang:num_requests_total         counter    <- requests_finished (aborted ones too)
    sglang:num_aborted_requests_total counter    <- aborted_requests
    sglang:num_running_reqs           gauge      <- num_running_reqs
    sglang:num_queue_reqs             gauge      <- num_waiting_reqs
    sglang:gen_throughput             gauge      <- gen_throughput (tokens/s)
    sglang:cache_hit_rate             gauge      <- cached_tokens / prompt_tokens (since start)
    sglang:time_to_first_token_seconds histogram <- TTFT, SGLang's bucket bounds
    sglang:e2e_request_latency_seconds histogram <- e2e latency, SGLang's bucket bounds

What we leave out, and why, is in docs/operating.md (Monitoring: Prometheus and Grafana).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LABELS = ["model_name"]
# sglang name (without _total) -> (our key, help)
COUNTERS = {
    "sglang:prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
    "sglang:generation_tokens": ("generated_tokens", "Number of generation tokens processed."),
    "sglang:cached_tokens": ("cached_tokens", "Number of cached prompt tokens."),
    "sglang:num_requests": ("requests_finished", "Number of requests processed."),
    "sglang:num_aborted_requests": ("aborted_requests", "Number of requests aborted."),
}
GAUGES = {
    "sglang:num_running_reqs": ("num_running_reqs", "The number of running requests."),
    "sglang:num_queue_reqs": ("num_waiting_reqs", "The number of requests in the waiting queue."),
    "sglang:gen_throughput": ("gen_throughput", "The generation throughput (token/s)."),
}
# sglang name -> our histogram's name (in RequestLatency.sglang_snapshot())
HISTOGRAMS = {
    "sglang:time_to_first_token_seconds": "time_to_first_token_seconds",
    "sglang:e2e_request_latency_seconds": "e2e_request_latency_seconds",
}


def collect(m: dict, model_name: str):
    """The sglang:* families of one metrics snapshot; a number it lacks is left out."""
    labels = [model_name]
    for name, (key, doc) in COUNTERS.items():
        if key in m:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, m[key])
            yield family
    for name, (key, doc) in GAUGES.items():
        if key in m:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, m[key])
            yield family
    if "prompt_tokens" in m:
        family = GaugeMetricFamily("sglang:cache_hit_rate", "The prefix cache hit rate.", labels=LABELS)
        family.add_metric(labels, m.get("cached_tokens", 0) / max(m["prompt_tokens"], 1))
        yield family
    snapshots = m.get("sglang_histograms", {})
    for name, ours in HISTOGRAMS.items():
        if ours in snapshots:
            h = snapshots[ours]
            doc = name.removeprefix("sglang:").replace("_", " ")
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            buckets = [(le if le == "+Inf" else repr(float(le)), n) for le, n in h["buckets"]]
            family.add_metric(labels, buckets, sum_value=h["sum"])
            yield family
