"""A client that goes away aborts its request, so its pages are freed at once.

The request is gated, not timed: once it runs, generation is paused (``/pause_generation``),
so it cannot finish however fast the machine is; the client then hangs up, and the abort
must land while the engine is paused (aborts do not wait for steps)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from tests.waits import wait

LONG = {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}


def _wait_metrics(server, ok, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if ok(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"{what}:\n{server.log_tail()}")


@contextlib.contextmanager
def paused(server):
    assert server.client.post("/pause_generation").status_code == 200
    try:
        yield
    finally:  # the server is shared: never leave it paused
        assert server.client.post("/continue_generation").status_code == 200


def _aborted_while_paused(server, before: float) -> dict:
    m = _wait_metrics(
        server,
        lambda m: m["hicache_aborted_requests_total"] > before and m["hicache_num_running_reqs"] == 0,
        "request not aborted",
    )
    assert m["hicache_generation_paused"] == 1
    assert m["hicache_num_waiting_reqs"] == 0
    return m


def test_streaming_client_disconnect_aborts(server):
    before = server.metrics()["hicache_aborted_requests_total"]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": LONG, "stream": True}
    with httpx.Client(base_url=server.url, timeout=wait(300)) as c:  # the first request compiles
        with c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one token seen: it runs
            with paused(server):
                r.close()  # hang up while it cannot finish
                _aborted_while_paused(server, before)
    assert server.healthy()


def test_non_streaming_client_disconnect_aborts(server):
    before = server.metrics()["hicache_aborted_requests_total"]
    body = {"input_ids": [9, 10, 11, 12], "sampling_params": LONG}

    async def hang_up_while_paused():
        async with httpx.AsyncClient(base_url=server.url, timeout=wait(300)) as c:
            call = asyncio.create_task(c.post("/generate", json=body))
            while not call.done():  # until it runs (holds pages)
                if (await c.get("/metrics")).text.count("hicache_num_running_reqs 1.0"):
                    break
                await asyncio.sleep(0.05)
            assert not call.done(), "the request finished before it could be paused"
            assert (await c.post("/pause_generation")).status_code == 200
            call.cancel()  # the client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await call

    try:
        asyncio.run(hang_up_while_paused())
        _aborted_while_paused(server, before)
    finally:
        assert server.client.post("/continue_generation").status_code == 200
    assert server.healthy()
    assert server.metrics()["hicache_generation_paused"] == 0
