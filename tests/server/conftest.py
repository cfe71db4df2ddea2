"""End-to-end server fixtures: the real binary, started as a subprocess from a flagfile.

One server (tiny preset, all three cache tiers, small buckets) is shared by every test in
``tests/server``; start-up and first compiles dominate the run time, so each extra server
costs seconds. Its log goes to a file that a failing start-up prints.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

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
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flagfile: str, *extra: str, log_path: str, headers: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.l3_dir: str | None = None
        cmd = [
            sys.executable,
            "-m",
            "hicache_jax.serve",
            f"--flagfile=configs/{flagfile}",
            f"--port={self.port}",
            *extra,
        ]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=server_env()
        )
        self.client = httpx.Client(base_url=self.url, timeout=120, headers=headers)
        self._wait_healthy(timeout=180)

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.close()
        pytest.fail(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.url + "/health", timeout=10).status_code == 200

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {name{labels}: value}."""
        text = self.client.get("/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def generate(self, **body) -> dict:
        r = self.client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


_shared: dict[str, object] = {"server": None, "users": 0}


def shared_server(tmp_path_factory) -> Iterator[Server]:
    """Yield THE shared server: configs/hicache_l3_cpu.flags (L1 + L2 + L3) with a private L3
    directory (``server.l3_dir``). Session fixtures in several test folders yield the same
    process; the last one to finish stops it."""
    s = _shared["server"]
    if s is None or s.proc.poll() is not None:
        tmp = tmp_path_factory.mktemp("server")
        s = Server(
            "hicache_l3_cpu.flags",
            *TEST_FLAGS,
            f"--hicache_storage_spec={tmp / 'l3'}",
            log_path=str(tmp / "server.log"),
        )
        s.l3_dir = str(tmp / "l3")
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
