"""A server started the way a user starts it (``python -m hicache_jax.serve``), as a child
process with its log in a file, for benchmarks and soak runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

REPO_CONFIGS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs"
)


class ServerError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        flags: list[str],
        *,
        log_path: str,
        startup_timeout: float = 300.0,
        env: dict | None = None,
        cwd: str | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "hicache_jax.serve", *flags, f"--port={self.port}"]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, env=env or dict(os.environ)
        )
        self._wait_healthy(startup_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.close()
        raise ServerError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.url + "/health", timeout=10).status_code == 200

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise ServerError("no VmRSS in /proc status")

    def close(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def metrics(url: str, client: httpx.Client | None = None) -> dict[str, float]:
    """``/metrics`` (Prometheus text) as ``{name: value}`` (labels kept in the name)."""
    text = (client or httpx).get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
