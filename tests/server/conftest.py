"""End-to-end server fixtures: the real binary, started as a subprocess from a flagfile.

One server (tiny preset, all three cache tiers, small buckets) is shared by every test in
``tests/server``; start-up and first compiles dominate the run time, so each extra server
costs seconds. Its log goes to a file that a failing start-up prints.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from hicache_jax.bench.server_process import ServerError, ServerProcess, metrics
from tests.waits import wait
from tests.xla_env import server_compile_cache_env, without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE_SIZE = 16
CONTEXT = 2048
# Small buckets keep compiles few and short; the context bounds the "too long" tests.
TEST_FLAGS = (
    "--chunked_prefill_size=64",
    "--max_running_requests=8",
    "--max_total_tokens=8192",
    f"--context_length={CONTEXT}",
    "--log_level=info",
)


def server_env() -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # tests/conftest.py asks for 8 emulated devices; one is faster for a single-device server.
    env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
    env.update(server_compile_cache_env(os.environ))
    return env


class Server(ServerProcess):
    """The server binary from a flagfile in ``configs/``, with an HTTP client; a failed
    start-up fails the test with the server's log."""

    def __init__(self, flagfile: str, *extra: str, log_path: str, headers: dict | None = None):
        self.l3_dir: str | None = None
        self.profile_dir: str | None = None
        self.client = None
        try:
            super().__init__(
                # The flagfiles warm up for users; a test's server compiles what it runs.
                [f"--flagfile=configs/{flagfile}", "--warmup=false", *extra],
                log_path=log_path,
                startup_timeout=wait(300),
                env=server_env(),
                cwd=ROOT,
            )
        except ServerError as e:
            pytest.fail(str(e))
        self.client = httpx.Client(base_url=self.url, timeout=wait(300), headers=headers)

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {name{labels}: value}."""
        return metrics(self.url, self.client)

    def generate(self, **body) -> dict:
        r = self.client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        super().close()


_shared: dict[str, object] = {"server": None, "users": 0}


def shared_server(tmp_path_factory) -> Iterator[Server]:
    """Yield THE shared server: configs/hicache_l3_cpu.flags (L1 + L2 + L3) with a private L3
    directory (``server.l3_dir``) and ``--profile_dir`` (``server.profile_dir``). Session
    fixtures in several test folders yield the same process; the last one to finish stops it."""
    s = _shared["server"]
    if s is None or s.proc.poll() is not None:
        tmp = tmp_path_factory.mktemp("server")
        s = Server(
            "hicache_l3_cpu.flags",
            *TEST_FLAGS,
            f"--hicache_storage_spec={tmp / 'l3'}",
            f"--profile_dir={tmp / 'profiles'}",
            log_path=str(tmp / "server.log"),
        )
        s.l3_dir = str(tmp / "l3")
        s.profile_dir = str(tmp / "profiles")
        _shared["server"] = s
    _shared["users"] += 1
    try:
        yield s
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            _shared["server"] = None
            s.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    yield from shared_server(tmp_path_factory)
