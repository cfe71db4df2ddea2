"""The engine loop's thread, without a server: once it has died, calls fail at once."""

from __future__ import annotations

import asyncio

import pytest

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
