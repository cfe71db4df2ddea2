"""The real sglang-router (``python -m sglang_router.launch_router``) as a child process for
the server tests, its log in a file: in front of ordinary workers, or in PD mode
(``--pd-disaggregation``) in front of prefill and decode servers."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from hicache_jax.bench.server_process import free_port
from tests.waits import wait


class Router:
    """``launch_router`` with ``args`` (the workers, the policy, ...) on private ports: its own
    and its Prometheus exporter's (the default, 29000, would clash between routers)."""

    def __init__(self, args: list[str], log_path: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *args]
        cmd += ["--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1]]
        cmd += ["--prometheus-port", str(free_port()), "--log-level", "info"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=wait(300))

    @classmethod
    def fleet(cls, workers: list[str], log_path: str, policy: str = "cache_aware") -> Router:
        """In front of ordinary workers, a dead one out of the rotation within seconds."""
        args = ["--worker-urls", *workers, "--policy", policy]
        # A dead worker leaves the rotation within seconds; a busy one on a loaded machine does not.
        args += ["--health-check-interval-secs", "1", "--health-failure-threshold", "2"]
        args += ["--health-check-timeout-secs", "20"]
        return cls(args, log_path)

    @classmethod
    def pd(
        cls,
        prefills: list[str],
        decodes: list[str],
        log_path: str,
        policy: str = "random",
        extra: tuple[str, ...] = (),
    ) -> Router:
        """PD mode: each request goes to one prefill and one decode server (no bootstrap port:
        the KV travels through L3), the client gets the decode server's answer. Started
        once it answers ``/health`` (it has checked its workers by then). ``extra``: more
        ``launch_router`` arguments."""
        args = ["--pd-disaggregation", "--policy", policy, *extra]
        for url in prefills:
            args += ["--prefill", url, "none"]
        for url in decodes:
            args += ["--decode", url]
        router = cls(args, log_path)
        router.wait_up()
        return router

    def wait_up(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + wait(timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.client.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"router not up after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def workers(self) -> dict[str, bool]:
        """Worker URL -> healthy, as the router sees it."""
        try:
            listed = self.client.get("/workers", timeout=10).json()["workers"]
        except (httpx.TransportError, ValueError, KeyError):
            return {}
        return {w["url"]: w["is_healthy"] for w in listed}

    def wait_for(self, healthy: dict[str, bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited:\n{self.log_tail()}"
            seen = self.workers()
            if all(seen.get(url) is want for url, want in healthy.items()):
                return
            time.sleep(0.3)
        pytest.fail(f"router never saw {healthy} (saw {self.workers()}):\n{self.log_tail()}")

    def post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        assert r.status_code == 200, f"{r.status_code} {r.text}\n{self.log_tail()}"
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
