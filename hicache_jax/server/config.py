"""Server-only settings (the engine's are ``EngineConfig``), validated on construction."""

from __future__ import annotations

import dataclasses
import os
import tempfile

LOG_LEVELS = ("debug", "info", "warning", "error")
PLATFORMS = ("auto", "cpu", "gpu", "tpu")


class ServerConfigError(ValueError):
    """An invalid server setting; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless asked: a model server is not a public service by default
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: model_path, or the preset's name
    log_level: str = "info"
    platform: str = "auto"  # JAX platform; auto lets JAX pick (TPU > GPU > CPU)
    profile_dir: str | None = None  # /start_profile writes under it only; None: <tmp>/hicache-jax-profile

    def profile_output_dir(self) -> str:
        return self.profile_dir or os.path.join(tempfile.gettempdir(), "hicache-jax-profile")

    def __post_init__(self):
        if not self.host:
            raise ServerConfigError("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ServerConfigError(f"--port={self.port}: must be in [0, 65535]")
        if self.api_key is not None and not self.api_key.strip():
            raise ServerConfigError("--api_key must not be empty (leave it out to disable authentication)")
        if self.log_level not in LOG_LEVELS:
            raise ServerConfigError(f"--log_level={self.log_level!r}: must be one of {LOG_LEVELS}")
        if self.platform not in PLATFORMS:
            raise ServerConfigError(f"--platform={self.platform!r}: must be one of {PLATFORMS}")
