"""Server-only settings (the engine's are ``EngineConfig``), validated on construction. Each
field is a ``setting``: its help, default and checks in one place, as in ``EngineConfig``."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from hicache_jax.config import check_fields, setting
from hicache_jax.server.tools.formats import PARSER_NAMES

LOG_LEVELS = ("debug", "info", "warning", "error")
PLATFORMS = ("auto", "cpu", "gpu", "tpu")


class ServerConfigError(ValueError):
    """An invalid server setting; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = setting(
        "127.0.0.1",
        "Interface to bind; 127.0.0.1 unless you mean to serve others (a model server is not a "
        "public service by default).",
        (lambda v, c: bool(v), "must not be empty"),
        show_value=False,
    )
    port: int = setting(30000, "TCP port.", (lambda v, c: 0 <= v <= 65535, "must be in [0, 65535]"))
    api_key: str | None = setting(
        None,
        "If set, every route but /health needs the header Authorization: Bearer KEY (401 otherwise).",
        (
            lambda v, c: v is None or bool(v.strip()),
            "must not be empty (leave it out to disable authentication)",
        ),
        shown_default="unset",
        show_value=False,  # a secret
    )
    allowed_hosts: str | None = setting(
        None,
        "Without --api_key: the host names (comma-separated) the server answers to. A request whose "
        "Host header, or whose browser Origin, names another gets 403 (DNS rebinding, cross-site "
        "pages). With --api_key the key alone decides.",
        shown_default="localhost, 127.0.0.1 and ::1 when --host is a loopback address; any otherwise",
    )
    served_model_name: str | None = setting(
        None, "Model name in the OpenAI API.", shown_default="--model_path or --preset"
    )
    log_level: str = setting(
        "info",
        "Log level (absl's -v / --verbosity wins when given).",
        (lambda v, c: v in LOG_LEVELS, f"must be one of {LOG_LEVELS}"),
        choices=LOG_LEVELS,
    )
    platform: str = setting(
        "auto",
        "JAX platform (auto: TPU > GPU > CPU).",
        (lambda v, c: v in PLATFORMS, f"must be one of {PLATFORMS}"),
        choices=PLATFORMS,
    )
    profile_dir: str | None = setting(
        None,
        "Where POST /start_profile writes jax.profiler traces; a body's output_dir must be a "
        "directory under it.",
        shown_default="<tmp>/hicache-jax-profile",
    )
    profile_max_traces: int = setting(
        16,
        "Most traces kept under --profile_dir; /start_profile is refused (400) at the limit.",
        (lambda v, c: v >= 1, "must be >= 1"),
    )
    profile_max_mb: float = setting(
        2048.0,
        "Most MB of traces under --profile_dir; /start_profile is refused (400) past it.",
        (lambda v, c: v > 0, "must be > 0"),
    )
    max_n: int = setting(
        128,
        "Most choices (n) one request may ask for (OpenAI's limit); under load a request's "
        "choices hold at most half the running batch while others wait.",
        (lambda v, c: v >= 1, "must be >= 1"),
    )
    flush_cache_wait_s: float = setting(
        30.0,
        "How long POST /flush_cache waits for the requests in flight to end (new ones are admitted "
        "meanwhile) before it is refused with 400.",
        (lambda v, c: v >= 0, "must be >= 0"),
    )

    chat_template: str | None = setting(
        None,
        "A jinja chat template file for /v1/chat/completions, in place of the model's.",
        (lambda v, c: v is None or os.path.isfile(v), "must be a readable file"),
        shown_default="the model's (tokenizer_config.json or chat_template.jinja)",
    )
    tool_call_parser: str | None = setting(
        None,
        "How /v1/chat/completions reads tool calls in the output of tool_choice=auto: "
        "SGLang's and vLLM's parser names (llama3, mistral, qwen25, hermes, gpt-oss, ...).",
        (lambda v, c: v is None or v in PARSER_NAMES, f"must be one of {sorted(PARSER_NAMES)}"),
        shown_default="guessed from the chat template",
    )

    def profile_output_dir(self) -> str:
        return self.profile_dir or os.path.join(tempfile.gettempdir(), "hicache-jax-profile")

    def __post_init__(self):
        check_fields(self, ServerConfigError, prefix="--")
