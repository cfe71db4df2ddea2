"""Per-request latency histograms for ``/metrics``: time to first token, time per output
token and end-to-end latency, observed by the engine thread as each request finishes.

Times run from the request's arrival at the engine (``Req.arrival``), so they include queueing
but not HTTP parsing. Buckets are fixed (Prometheus histograms aggregate across servers only
with the same buckets)."""

from __future__ import annotations

import bisect
import dataclasses

from hicache_jax import finish
from hicache_jax.finish import Finish

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# SGLang's default bounds (sglang/srt/metrics/collector.py), kept in a second histogram of the
# same observations so that sglang:* families aggregate with an SGLang fleet's.
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E_BUCKETS = (*SGLANG_TTFT_BUCKETS, 600, 1200, 1800, 2400)


@dataclasses.dataclass
class Histogram:
    bounds: tuple[float, ...]  # upper bounds, increasing; +Inf is implied
    counts: list[int] = dataclasses.field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0

    def __post_init__(self):
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must increase: {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.total += value

    def snapshot(self) -> dict:
        """{"buckets": [[le, cumulative count], ..., ["+Inf", count]], "sum": s, "count": n}."""
        cum, out = 0, []
        for le, c in zip([*map(float, self.bounds), "+Inf"], self.counts):
            cum += c
            out.append([le, cum])
        return {"buckets": out, "sum": self.total, "count": cum}


class RequestLatency:
    """The three histograms, fed one finished request at a time; TTFT and e2e are also kept
    with SGLang's bounds (``sglang_snapshot``)."""

    def __init__(self) -> None:
        self.hist = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "time_per_output_token_seconds": Histogram(TPOT_BUCKETS),
            "e2e_request_latency_seconds": Histogram(E2E_BUCKETS),
        }
        self.sglang = {
            "time_to_first_token_seconds": Histogram(SGLANG_TTFT_BUCKETS),
            "e2e_request_latency_seconds": Histogram(SGLANG_E2E_BUCKETS),
        }

    def observe(self, req) -> None:
        if req.first_token_time is None or req.finish_time is None:
            return  # finished without a token: no latency to speak of
        if finish.kind(req.finish_reason) is Finish.ABORT:
            return  # cut short: its times say nothing about serving
        for hist in (self.hist, self.sglang):
            hist["time_to_first_token_seconds"].observe(req.first_token_time - req.arrival)
            hist["e2e_request_latency_seconds"].observe(req.finish_time - req.arrival)
        n = len(req.output_ids)
        if n > 1:
            tpot = (req.finish_time - req.first_token_time) / (n - 1)
            self.hist["time_per_output_token_seconds"].observe(tpot)

    def snapshot(self) -> dict[str, dict]:
        return {name: h.snapshot() for name, h in self.hist.items()}

    def sglang_snapshot(self) -> dict[str, dict]:
        """TTFT and e2e with SGLang's bounds, by our histogram's name."""
        return {name: h.snapshot() for name, h in self.sglang.items()}
