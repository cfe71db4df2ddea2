"""The queues between the HTTP side and the engine are bounded: the waiting queue by prompt
tokens (beyond it a request gets 503 and nothing is queued), and a streaming request's
events by coalescing (a reader that stalls holds the latest output, not every one)."""

import asyncio
import dataclasses

import pytest
from fastapi.testclient import TestClient

from hicache_jax import LLM
from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.outputs import OutputDelta
from hicache_jax.sampling_params import QueueFull
from hicache_jax.server.app import create_app
from hicache_jax.server.config import ServerConfig
from hicache_jax.server.engine_loop import EngineLoop
from hicache_jax.server.messages import Failure, Sink, Update
from hicache_jax.server.state import ServerState
from tests.reliability.workload import _tokens

CFG = EngineConfig(
    preset="tiny",
    page_size=16,
    chunked_prefill_size=32,
    max_running_requests=2,
    max_total_tokens=256,
    max_queued_tokens=100,
)


def test_waiting_queue_is_bounded_in_tokens():
    engine = Engine(CFG)
    sp = {"max_new_tokens": 2}
    rids = [engine.add_request(input_ids=_tokens(i, 30), sampling_params=sp) for i in range(3)]  # 90
    with pytest.raises(QueueFull, match="max_queued_tokens=100"):
        engine.add_request(input_ids=_tokens(9, 11), sampling_params=sp)
    rids.append(engine.add_request(input_ids=_tokens(9, 10), sampling_params=sp))  # exactly 100
    engine.step()  # two are admitted: their tokens leave the queue
    assert engine.scheduler.queued_tokens == 40
    rids.append(engine.add_request(input_ids=_tokens(10, 60), sampling_params=sp))
    while engine.has_unfinished():
        engine.step()
    assert [engine.pop_output(r)["meta_info"]["finish_reason"]["type"] for r in rids] == ["length"] * 5
    assert engine.scheduler.queued_tokens == 0
    assert engine.flush_cache().success


def test_full_queue_is_a_503_and_queues_nothing():
    engine = Engine(CFG)
    loop = EngineLoop(engine)
    app = create_app(ServerState.from_engine(engine, loop, ServerConfig()))
    with TestClient(app, base_url="http://127.0.0.1") as client:  # a name the server answers to
        batch = {"input_ids": [_tokens(1, 60), _tokens(2, 60)], "sampling_params": {"max_new_tokens": 2}}
        r = client.post("/generate", json=batch)
        assert r.status_code == 503, r.text
        assert "max_queued_tokens" in r.json()["error"]["message"]
        assert engine.scheduler.queued_tokens == 0 and not engine.requests  # all or none
        ok = client.post(
            "/generate", json={"input_ids": _tokens(3, 60), "sampling_params": {"max_new_tokens": 2}}
        )
        assert ok.status_code == 200


def test_stream_events_coalesce_for_a_slow_reader():
    async def scenario():
        sink = Sink("r")
        for n in range(1000):  # the engine produces 1000 deltas nobody reads yet
            sink.put(Update(OutputDelta([f"t{n} "], [n], None, None, {"completion_tokens": n + 1}), False))
        sink.put(Update({"output_ids": list(range(1000))}, finished=True))
        sink.put(Failure("late"))  # never merged away: only partial updates coalesce
        await asyncio.sleep(0)  # let the engine thread's call_soon callbacks run
        assert sink.queue.qsize() == 3
        first = await sink.queue.get()  # every delta, joined in order
        assert not first.finished and first.out.output_ids == list(range(1000))
        assert first.out.text == "".join(f"t{n} " for n in range(1000))
        assert first.out.meta["completion_tokens"] == 1000
        assert (await sink.queue.get()).finished
        assert isinstance(await sink.queue.get(), Failure)

    asyncio.run(scenario())


def test_offline_batch_larger_than_the_queue_runs_whole():
    llm = LLM(**dataclasses.asdict(CFG))
    prompts = [_tokens(20 + i, 30) for i in range(8)]  # 240 prompt tokens, queue holds 100
    outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert [len(o["output_ids"]) for o in outs] == [2] * 8
