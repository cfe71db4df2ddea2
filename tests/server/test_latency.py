"""Latency histograms: bucket counts agree with counting the observations directly."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.request import Req
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.server.latency import TTFT_BUCKETS, Histogram, RequestLatency


def test_histogram_matches_direct_count():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.exponential(1.0, 300), np.array(TTFT_BUCKETS)])  # edges included
    h = Histogram(TTFT_BUCKETS)
    for v in values:
        h.observe(float(v))
    snap = h.snapshot()
    for le, cum in snap["buckets"][:-1]:
        assert cum == int(np.sum(values <= le)), le  # Prometheus' le: value <= bound
    assert snap["buckets"][-1] == ["+Inf", len(values)] and snap["count"] == len(values)
    assert snap["sum"] == pytest.approx(float(values.sum()))


def test_bad_bounds_refused():
    with pytest.raises(ValueError, match="increase"):
        Histogram((1.0, 0.5))


def _req(arrival, first, finish, n, reason="length"):
    r = Req(rid="r", input_ids=[1], sampling=SamplingParams())
    r.arrival, r.first_token_time, r.finish_time = arrival, first, finish
    r.output_ids, r.finish_reason = [0] * n, {"type": reason}
    return r


def test_request_latency():
    lat = RequestLatency()
    lat.observe(_req(10.0, 10.5, 12.5, 5))  # ttft 0.5, tpot (2.0 / 4) = 0.5, e2e 2.5
    lat.observe(_req(0.0, 0.2, 0.2, 1))  # one token: no tpot
    lat.observe(_req(0.0, 0.1, 9.0, 9, reason="abort"))  # aborted: not observed
    s = lat.snapshot()
    assert s["time_to_first_token_seconds"]["count"] == 2
    assert s["time_to_first_token_seconds"]["sum"] == pytest.approx(0.7)
    assert s["time_per_output_token_seconds"]["count"] == 1
    assert s["time_per_output_token_seconds"]["sum"] == pytest.approx(0.5)
    assert s["e2e_request_latency_seconds"]["sum"] == pytest.approx(2.7)
