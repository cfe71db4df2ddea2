"""A fleet behind the real sglang-router: two servers sharing one file L3, ``cache_aware`` routing.

Concurrent multi-turn conversations go through the router; each turn's prompt extends the last
one. A conversation that returns to the server holding it is served from that server's device
pages, so every later turn's device hits cover the previous prompt and no server reads L3.
Streaming, the OpenAI routes and ``/flush_cache`` pass through. Then one server is killed
(SIGKILL) and the survivor serves the dead server's conversations from the shared L3.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.server.conftest import PAGE_SIZE, TEST_FLAGS, Server
from tests.server.router import Router

pytest.importorskip("sglang_router")

CONVERSATIONS = 4
TURNS = 3  # before the kill; one more after it
GEN = {"max_new_tokens": 4, "temperature": 0}
WORDS = "alpha bravo cobalt delta ember fjord granite harbor indigo juniper kelp lumen maple nectar".split()


def turn_text(conv: int, turn: int) -> str:
    """Conversation ``conv``'s prompt at ``turn``: the previous turn's prompt and more words."""
    words = np.random.default_rng(100 + conv).choice(WORDS, size=40 + 24 * TURNS)
    return f"{conv}: " + " ".join(words[: 40 + 24 * turn])


def generate(router: Router, text: str) -> dict:
    return router.post("/generate", {"text": text, "sampling_params": GEN})["meta_info"]


def counters(server: Server) -> dict:
    return server.client.get("/server_info").json()["metrics"]


def wait_l3_written(server: Server, timeout: float = 60) -> None:
    """Until the server's L3 writes are done: none pending and the count steady for a second."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        m = counters(server)
        now = (m["l3_writes"], m["host_backups"])
        if m["l3_pending_writes"] == 0 and now[0] > 0 and now == last:
            return
        last = now
        time.sleep(1.0)
    pytest.fail(f"L3 writes never settled: {counters(server)}")


@pytest.fixture
def fleet(tmp_path):
    """Two servers on one L3 directory behind the router; every process is stopped after."""
    l3 = tmp_path / "l3"
    flags = ("hicache_l3_cpu.flags", *TEST_FLAGS, f"--hicache_storage_spec={l3}")
    flags += ("--hicache_prefetch_threshold=16",)  # the prompts are a few hundred tokens
    servers: list[Server] = []
    router = None
    try:
        with ThreadPoolExecutor(2) as pool:
            logs = [str(tmp_path / f"server{i}.log") for i in range(2)]
            futures = [pool.submit(Server, *flags, log_path=log) for log in logs]
            for f in futures:
                if f.exception() is None:
                    servers.append(f.result())
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
        router = Router.fleet([s.url for s in servers], str(tmp_path / "router.log"))
        router.wait_for({s.url: True for s in servers})
        yield servers, router
    finally:
        if router is not None:
            router.close()
        for s in servers:
            s.close()


def test_fleet_behind_sglang_router(fleet):
    servers, router = fleet

    # Concurrent conversations, each turn after the first back on the server that holds it.
    def converse(conv: int) -> list[dict]:
        return [generate(router, turn_text(conv, t)) for t in range(TURNS)]

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        metas = list(pool.map(converse, range(CONVERSATIONS)))
    for conv, turns in enumerate(metas):
        assert turns[0]["prompt_tokens"] >= 8 * PAGE_SIZE, turns[0]
        for prev, meta in zip(turns, turns[1:]):
            details = meta["cached_tokens_details"]
            assert details["device"] >= prev["prompt_tokens"] - PAGE_SIZE, (conv, meta)
            assert details["storage"] == 0, (conv, meta)
    before = [counters(s) for s in servers]
    held = [m["requests_finished"] // TURNS for m in before]
    assert [m["requests_finished"] % TURNS for m in before] == [0, 0], before
    assert sum(held) == CONVERSATIONS and min(held) >= 1, held  # both servers hold some
    for m in before:
        assert m["cached_tokens_device"] > 0 and m["cached_tokens_storage"] == 0, m

    # The rest of the surface passes through: streaming, the OpenAI routes.
    with router.client.stream(
        "POST", "/generate", json={"text": "stream me", "stream": True, "sampling_params": GEN}
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2, events
    for path, body in (
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}),
    ):
        r = router.client.post(path, json={"model": "tiny", "temperature": 0, **body})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4, r.json()
        r = router.client.post(path, json={"model": "tiny", "stream": True, **body})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text

    # Kill the server holding more conversations; the other serves them from the shared L3.
    victim = int(np.argmax(held))
    survivor = servers[1 - victim]
    wait_l3_written(servers[victim])
    servers[victim].proc.send_signal(signal.SIGKILL)
    servers[victim].proc.wait(30)
    router.wait_for({servers[victim].url: False, survivor.url: True})
    start = counters(survivor)
    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        last = list(pool.map(lambda conv: generate(router, turn_text(conv, TURNS)), range(CONVERSATIONS)))
    print(f"conversations per server {held}; device hits {[m['cached_tokens_device'] for m in before]}")
    moved = 0
    for conv, meta in enumerate(last):
        prev = metas[conv][-1]["prompt_tokens"]
        details = meta["cached_tokens_details"]
        assert meta["cached_tokens"] >= prev - PAGE_SIZE, (conv, meta)
        moved += details["storage"] > 0
    assert moved == held[victim], (held, last)
    after = counters(survivor)
    assert after["requests_finished"] - start["requests_finished"] == CONVERSATIONS
    print(f"after the kill: {moved} conversations moved, {[m['cached_tokens_details'] for m in last]}")
    assert after["cached_tokens_storage"] - start["cached_tokens_storage"] >= held[victim] * 4 * PAGE_SIZE

    # /flush_cache reaches the survivor (the router reports the dead worker as failed): the
    # survivor's next repeat comes from L3 rather than device pages.
    r = router.client.post("/flush_cache")
    assert r.status_code == 206 and r.json()["successful"] == [survivor.url], r.text
    meta = generate(router, turn_text(0, TURNS))
    assert meta["cached_tokens_details"]["device"] == 0 and meta["cached_tokens_details"]["storage"] > 0, meta
