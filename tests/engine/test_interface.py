"""``EngineAPI`` is what the engine loop calls: ``Engine``, ``LeaderEngine`` and the tests' fake
engines all have every member, and ``LeaderEngine`` defines each one itself (so no call the
loop makes can slip past its recording through the ``__getattr__`` pass-through)."""

from __future__ import annotations

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.interface import EngineAPI
from hicache_jax.multihost.replicated import DEVICE_CALLS, STATE_CALLS, LeaderEngine
from tests.reliability.test_request_ids import CountingEngine
from tests.server.fake_engine import FakeEngine
from tests.server.test_engine_loop import DyingEngine
from tests.server.test_streaming import SCRIPT, TOK, ScriptedEngine

MEMBERS = set(EngineAPI.__annotations__) | {
    name for name, value in vars(EngineAPI).items() if callable(value) and not name.startswith("_")
}


def test_the_members_are_what_the_loop_uses():
    assert MEMBERS >= {"step", "add_request", "abort", "pop_output", "broken", "close", "heartbeat"}
    assert MEMBERS >= {"flush_cache", "clear_storage", "recover", "metrics", "requests", "stats", "cfg"}


def test_engine_and_leader_engine_satisfy_it():
    engine = Engine(EngineConfig(preset="tiny", page_size=16, max_total_tokens=256))
    assert isinstance(engine, EngineAPI)
    leader = LeaderEngine(engine)
    assert isinstance(leader, EngineAPI)
    assert leader.broken is None and leader.cfg is engine.cfg and leader.requests is engine.requests
    assert leader.context_len == engine.context_len  # a start-up fact, passed through


def test_leader_engine_defines_every_member_and_every_recorded_call():
    defined = {name for klass in LeaderEngine.__mro__ for name in vars(klass)}
    assert MEMBERS - defined == set()
    assert (DEVICE_CALLS | STATE_CALLS) - defined == set()


def test_the_fake_engines_satisfy_it():
    for fake in (FakeEngine(), DyingEngine(), CountingEngine(), ScriptedEngine(TOK, SCRIPT)):
        assert isinstance(fake, EngineAPI), type(fake).__name__
