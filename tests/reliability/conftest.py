"""Shared pieces of the L3 reliability tests: tiny engines whose L3 can be made to fail,
real servers, and the server shared with ``tests/server``.

Every in-process engine here has the same shapes as ``tests/cache/l3_helpers.hicache_llm``
with the tiny preset, so the step programs compile once per test process. The servers all
run the same flags (L3 location and deadline aside) and share the run's persistent JAX
compilation cache (``tests/conftest.py``), so only the first one compiles.
"""

from __future__ import annotations

import logging

import pytest

from hicache_jax.storage.breaker import BreakerConfig, CircuitBreaker
from hicache_jax.storage.faults import FaultyStore, inject
from hicache_jax.storage.guard import PATHS
from hicache_jax.storage.keys import page_hashes
from hicache_jax.storage.layout import page_path
from tests.cache.l3_helpers import P, hicache_llm
from tests.server.conftest import TEST_FLAGS, Server, shared_server

L3_LOGGERS = ("hicache_jax.storage", "hicache_jax.cache.storage_tier")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """``tests/server``'s server process (one per session), for the HTTP tests here."""
    yield from shared_server(tmp_path_factory)


@pytest.fixture
def make_llm(tmp_path):
    """``make_llm(**EngineConfig overrides)`` -> an LLM on a private L3 directory; every
    engine made is healed and closed at the end of the test."""
    made = []

    def make(spec=None, **kw):
        llm = hicache_llm(spec or tmp_path / "l3", preset="tiny", **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        store = llm.engine.storage.client.store
        if isinstance(store, FaultyStore):
            store.heal()
        llm.close()


@pytest.fixture
def start_server(tmp_path):
    """``start_server(l3_spec, *flags, name=...)`` -> a running server (all three tiers) on
    that L3; stopped at the end of the test unless already dead. Every server of the run
    shares one persistent compilation cache (``tests/conftest.py``)."""
    servers = []

    def start(spec, *flags: str, name: str = "server") -> Server:
        server = Server(
            "hicache_l3_cpu.flags",
            *TEST_FLAGS,
            f"--hicache_storage_spec={spec}",
            *flags,
            log_path=str(tmp_path / f"{name}.log"),
        )
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def faulty(llm) -> FaultyStore:
    return inject(llm.engine.storage.client)


def set_breakers(llm, threshold: int = 2, backoff_s: float = 0.3) -> None:
    """Breakers that trip and retry fast enough for a test."""
    cfg = BreakerConfig(threshold=threshold, backoff_s=backoff_s, max_backoff_s=backoff_s)
    llm.engine.storage.client.guard.breakers = {p: CircuitBreaker(cfg) for p in PATHS}


def kv_keys(llm, ids) -> list[str]:
    """The full-attention page keys of a prompt, as the engine stores them."""
    ns = llm.engine.storage.namespace
    return [page_path(ns, h, "kv") for h in page_hashes(ids[: len(ids) // P * P], P, ns)]


def l3_log_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(L3_LOGGERS) and r.levelno >= logging.WARNING
    ]
