"""A client that goes away aborts its request, so its pages are freed at once."""

from __future__ import annotations

import time

import httpx

LONG = {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}


def _wait_aborted(server, before: float, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["hicache_aborted_requests_total"] > before and m["hicache_num_running_reqs"] == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"request not aborted:\n{server.log_tail()}")


def test_streaming_client_disconnect_aborts(server):
    before = server.metrics()["hicache_aborted_requests_total"]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": LONG, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one token seen; hang up
    m = _wait_aborted(server, before)
    assert m["hicache_num_waiting_reqs"] == 0


def test_non_streaming_client_disconnect_aborts(server):
    before = server.metrics()["hicache_aborted_requests_total"]
    body = {"input_ids": [9, 10, 11, 12], "sampling_params": LONG}
    try:
        httpx.post(server.url + "/generate", json=body, timeout=1.0)
        raise AssertionError("1900 tokens in under a second: the test needs a longer request")
    except httpx.ReadTimeout:
        pass  # the client hung up
    _wait_aborted(server, before)
    assert server.healthy()
