"""The engine loop's thread, without a server: once it has died, calls fail at once; a flush
waits a bounded time and holds nobody."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from hicache_jax.engine.flush_result import FlushResult
from hicache_jax.metric_kinds import Metrics
from hicache_jax.server.engine_loop import EngineLoop
from hicache_jax.server.errors import ApiError
from hicache_jax.server.messages import Sink
from tests.server.fake_engine import FakeEngine


class DyingEngine(FakeEngine):
    """Its first ``has_unfinished`` raises what no handler catches, killing the loop thread."""

    def has_unfinished(self) -> bool:
        raise SystemExit("engine gone")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death itself
def test_calls_into_a_dead_loop_fail_fast_instead_of_hanging():
    async def scenario() -> None:
        loop = EngineLoop(DyingEngine())
        loop.start()
        loop._thread.join(10)
        assert not loop._thread.is_alive() and not loop.healthy
        for call in (loop.generate([{"rid": "x"}]), loop.flush(), loop.metrics()):
            with pytest.raises(ApiError) as e:
                await asyncio.wait_for(call, timeout=5)  # a hang would be a TimeoutError
            assert e.value.status == 503
        loop.abort(Sink("x"))  # called from handlers' finally blocks: never raises

    asyncio.run(scenario())


class Endless(FakeEngine):
    """Requests that never finish until told to, and a record of what was flushed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[str] = set()
        self.flushed = 0

    def add_request(self, *args, rid: str, **kwargs) -> str:
        self.live.add(rid)
        self.requests[rid] = types.SimpleNamespace(arrival=time.monotonic(), timing={}, finished=False)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list:
        time.sleep(0.005)
        return []

    def flush_cache(self) -> FlushResult:
        self.flushed += 1
        return FlushResult(True, "flushed")

    def metrics(self) -> Metrics:
        return Metrics().gauges({"num_running_reqs": len(self.live), "num_waiting_reqs": 0})


def test_a_flush_waits_a_bounded_time_and_never_holds_new_requests():
    """A flush behind a request that does not end is refused after ``flush_wait_s``; requests
    sent while it waits are taken at once (finding 4 of issue 39: a probe waited 38 s behind
    one request); a flush with nothing in flight runs at once."""

    async def scenario() -> None:
        engine = Endless()
        loop = EngineLoop(engine, flush_wait_s=0.5)
        loop.start()
        try:
            await loop.generate([{"rid": "long"}])
            t0 = time.monotonic()
            flush = asyncio.ensure_future(loop.flush())
            await asyncio.sleep(0.05)
            await asyncio.wait_for(loop.generate([{"rid": "probe"}]), timeout=0.3)  # not held
            assert "probe" in engine.live and not flush.done()
            result = await asyncio.wait_for(flush, timeout=5)
            took = time.monotonic() - t0
            assert not result.success and not result.failed and 0.5 <= took < 2, (result, took)
            assert "2 requests are still running" in result.message and engine.flushed == 0
            engine.live.clear()
            result = await asyncio.wait_for(loop.flush(), timeout=1)
            assert result.success and engine.flushed == 1
        finally:
            loop.stop()

    asyncio.run(scenario())
