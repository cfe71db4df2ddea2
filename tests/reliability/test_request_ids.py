"""Client request ids: an rid in flight is refused with a 4xx and the request that holds it
runs on undisturbed; an rid is free again once its request finished or was aborted, however
often and however concurrently it is reused."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
import uuid

import httpx
import numpy as np
import pytest

from hicache_jax.sampling_params import InvalidRequest, SamplingParams
from hicache_jax.server.engine_loop import EngineLoop
from hicache_jax.server.messages import Abort, Generate, Reply, Sink, Update
from tests.server.fake_engine import FakeEngine
from tests.waits import wait

LONG = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
SHORT = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


def _ids(seed: int, n: int = 24) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def _reference(server, ids, sp) -> list[int]:
    """The same prompt computed from scratch (a fresh salt: nothing cached, no rid)."""
    return server.generate(input_ids=ids, sampling_params=sp, cache_salt=uuid.uuid4().hex)["output_ids"]


def _refused(r: httpx.Response, words: str) -> None:
    assert 400 <= r.status_code < 500, r.text
    assert words in r.json()["error"]["message"], r.text


def test_rid_in_flight_is_refused_and_the_holder_finishes(server):
    rid, ids = f"busy-{uuid.uuid4().hex}", _ids(1)
    other = f"other-{uuid.uuid4().hex}"
    with httpx.Client(base_url=server.url, timeout=wait(300)) as c:
        body = {"input_ids": ids, "sampling_params": LONG, "rid": rid, "stream": True}
        with c.stream("POST", "/generate", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["meta_info"]["id"] == rid  # in flight now

            one = {"input_ids": [5, 6], "sampling_params": SHORT}
            _refused(c.post("/generate", json=one | {"rid": rid}), "already in use")
            batch = {"input_ids": [[5, 6], [7, 8]], "sampling_params": SHORT, "rid": [other, rid]}
            _refused(c.post("/generate", json=batch), "already in use")
            twice = {"input_ids": [[5, 6], [7, 8]], "sampling_params": SHORT, "rid": [other, other]}
            _refused(c.post("/generate", json=twice), "distinct")
            streamed = one | {"rid": rid, "stream": True}
            _refused(c.post("/generate", json=streamed), "already in use")
            assert server.metrics()["hicache_num_running_reqs"] >= 1, "the holder ended too soon to test"
            # The refused batch left nothing behind: its other rid is free at once.
            assert c.post("/generate", json=one | {"rid": other}).status_code == 200

            events = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    final = events[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["output_ids"] == _reference(server, ids, LONG)


def test_rid_reused_right_after_finishing_many_times_concurrently(server):
    """Three clients reuse their own rid 12 times each (plain and streaming), while two
    others send requests without an rid; every answer is complete and right."""
    prompts = {k: _ids(10 + k, 8) for k in range(5)}
    want = {k: _reference(server, ids, SHORT) for k, ids in prompts.items()}

    def reuse(k: int) -> int:
        rid = f"reuse-{k}-{uuid.uuid4().hex}"
        with httpx.Client(base_url=server.url, timeout=wait(300)) as c:
            for i in range(12):
                body = {"input_ids": prompts[k], "sampling_params": SHORT, "rid": rid}
                if i % 3 == 2:
                    r = c.post("/generate", json=body | {"stream": True})
                    assert r.status_code == 200, r.text
                    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                    assert events[-1] == "[DONE]"
                    out = json.loads(events[-2])
                else:
                    r = c.post("/generate", json=body)
                    assert r.status_code == 200, r.text
                    out = r.json()
                assert out["meta_info"]["id"] == rid and out["output_ids"] == want[k], out
        return 12

    def anonymous(k: int) -> int:
        with httpx.Client(base_url=server.url, timeout=wait(300)) as c:
            for _ in range(8):
                r = c.post("/generate", json={"input_ids": prompts[k], "sampling_params": SHORT})
                assert r.status_code == 200 and r.json()["output_ids"] == want[k], r.text
        return 8

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        jobs = [pool.submit(reuse, k) for k in range(3)] + [pool.submit(anonymous, k) for k in (3, 4)]
        assert sum(j.result() for j in jobs) == 3 * 12 + 2 * 8
    assert server.metrics()["hicache_num_running_reqs"] == 0


def test_rid_reused_after_a_disconnect(server):
    rid, ids = f"gone-{uuid.uuid4().hex}", _ids(2)
    body = {"input_ids": ids, "sampling_params": LONG, "rid": rid, "stream": True}
    with httpx.Client(base_url=server.url, timeout=wait(120)) as c:
        with c.stream("POST", "/generate", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))  # in flight; hang up
    deadline = time.monotonic() + 30
    while True:  # "in use" until the server has seen the disconnect and aborted it
        r = httpx.post(server.url + "/generate", json=body | {"stream": False}, timeout=wait(300))
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        _refused(r, "already in use")
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == _reference(server, ids, LONG)


# ---- the engine loop's bookkeeping, exactly: a stale abort must not hit a reused rid ------------
@dataclasses.dataclass
class FakeReq:
    rid: str
    max_new_tokens: int
    output_ids: list = dataclasses.field(default_factory=list)
    finished: bool = False
    aborted: bool = False
    stream: bool = False
    # The times the loop's latency histograms read, kept as the real Req keeps them.
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: dict | None = None
    timing: dict = dataclasses.field(default_factory=dict)


class CountingEngine(FakeEngine):
    """The slice of ``Engine`` the loop uses, with the real one's rid rules: a rid is taken
    from ``add_request`` until ``pop_output``; each step adds one token to every request."""

    def __init__(self) -> None:
        self.requests: dict[str, FakeReq] = {}
        self.stats = {"generated_tokens": 0}

    def add_request(self, *, rid: str, sampling_params: dict, **_) -> str:
        if rid in self.requests:
            raise InvalidRequest(f"rid {rid!r} is already in use")
        self.requests[rid] = FakeReq(rid, SamplingParams.from_dict(sampling_params).max_new_tokens)
        return rid

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    def step(self) -> list[FakeReq]:
        live = [r for r in self.requests.values() if not r.finished]
        now = time.monotonic()
        for r in live:
            r.output_ids.append(len(r.output_ids))
            r.first_token_time = r.first_token_time or now
            r.finished = len(r.output_ids) >= r.max_new_tokens
            if r.finished:
                r.finish_time, r.finish_reason = now, {"type": "length"}
        return live

    def abort(self, rid: str) -> bool:
        r = self.requests.get(rid)
        if r is None or r.finished:
            return False
        r.finished = r.aborted = True
        r.finish_time, r.finish_reason = time.monotonic(), {"type": "abort"}
        return True

    def output(self, rid: str) -> dict:
        r = self.requests[rid]
        return {"output_ids": list(r.output_ids), "aborted": r.aborted}

    def pop_output(self, rid: str) -> dict:
        out = self.output(rid)
        del self.requests[rid]
        return out


@pytest.mark.parametrize("first_ends_by", ["finishing", "abort"])
def test_stale_abort_never_hits_a_reused_rid(first_ends_by):
    """Client A's request "x" ends; client B reuses "x"; then A's abort arrives (A's handler
    saw its client leave just as the request ended). B's request must run to its end."""

    async def scenario() -> None:
        engine = CountingEngine()
        loop = EngineLoop(engine)

        async def submit(n: int) -> Sink:
            sink, reply = Sink("x"), Reply()
            loop._handle(Generate([{"rid": "x", "sampling_params": {"max_new_tokens": n}}], [sink], reply))
            assert await reply is None
            return sink

        a = await submit(2)
        if first_ends_by == "finishing":
            loop._step(), loop._step()
        else:
            loop._handle(Abort(a.rid, a))
        assert "x" not in engine.requests  # free again
        b = await submit(5)
        loop._handle(Abort(a.rid, a))  # late: names the old request
        while engine.has_unfinished():
            loop._step()
        await asyncio.sleep(0)  # let the sinks' call_soon_threadsafe callbacks run
        events = [b.queue.get_nowait() for _ in range(b.queue.qsize())]
        assert len(events) == 1 and isinstance(events[0], Update) and events[0].finished
        assert events[0].out == {"output_ids": [0, 1, 2, 3, 4], "aborted": False}

    asyncio.run(scenario())
