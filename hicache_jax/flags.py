"""The server's absl flags: defined here, parsed here into ``EngineConfig`` + ``ServerConfig``.
Nothing else reads ``FLAGS``.

Every ``EngineConfig`` field is a flag of the same name (type from the field), so a field
added to the config is a flag at once; ``ENGINE_HELP`` gives the ones we document.
Invalid or contradictory values raise ``FlagError`` whose message names the flag.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing

from absl import flags

from hicache_jax.config import PREFETCH_POLICIES, WRITE_POLICIES, ConfigError, EngineConfig
from hicache_jax.hub import SHORT_NAMES, ModelNotFound, installed_model, is_repo_id
from hicache_jax.server.config import LOG_LEVELS, PLATFORMS, ServerConfig, ServerConfigError

ENGINE_HELP = {
    "model_path": (
        "HF or orbax (hicache_jax.convert) model directory, or a Hugging Face model id (org/name) "
        "fetched into the Hub cache (HF_HOME, HF_HUB_OFFLINE); unset: the built-in --preset."
    ),
    "revision": "Hub branch, tag or commit for a --model_path model id (default: main).",
    "preset": "Built-in random-weight preset when --model_path is unset: tiny, tiny-swa, tiny-mamba, 100m.",
    "dtype": "Weights and KV dtype: auto (the checkpoint's), float32, bfloat16, float16.",
    "page_size": "Tokens per KV page (a power of two); also the L3 page.",
    "chunked_prefill_size": "Most prompt tokens prefilled per step (a multiple of --page_size).",
    "max_running_requests": "Most requests in the running batch.",
    "max_total_tokens": "Device KV capacity in tokens (the full-attention page pool).",
    "swa_full_tokens_ratio": "Sliding-window page pool size relative to the full pool, in (0, 1].",
    "mamba_cache_slots": "Mamba state slots (working + snapshots); default 4 x --max_running_requests.",
    "max_queued_tokens": "Most prompt tokens waiting to run; beyond it requests get 503 (default 16 x pool).",
    "context_length": "Longest prompt + completion; default: the model's max_position_embeddings.",
    "disable_radix_cache": "Turn off prefix caching.",
    "schedule_policy": (
        "Queue order: fcfs (arrival), or lpm (longest cached prefix first, L2 and L3 included; "
        "a request waiting 64 steps goes first, and queues over 128 fall back to fcfs)."
    ),
    "attention_backend": "xla (reference; CPU default) or pallas (TPU/GPU default).",
    "ssd_backend": "Mamba2 SSD kernel: xla or pallas.",
    "kernel_interpret": "Run Pallas kernels in interpret mode (CPU testing).",
    "random_seed": "Seed for preset weights and for requests without a sampling seed.",
    "tp_size": "Tensor-parallel degree: a mesh of the first tp_size devices (README: Tensor parallel).",
    "dist_coordinator": "host:port of process 0 when several processes share one mesh (jax.distributed).",
    "dist_num_processes": "Processes (hosts) sharing the mesh; 1: this process alone.",
    "dist_process_id": "This process's index in [0, --dist_num_processes).",
    "warmup": "Compile every step shape bucket before serving, so no request waits for a compile.",
    "enable_hierarchical_cache": "Copy device pages to host memory (L2) and, with a backend, storage (L3).",
    "hicache_ratio": "Host pool size as a multiple of the device pool.",
    "hicache_size_gb": "Host pool size in GB (overrides --hicache_ratio when > 0).",
    "hicache_write_policy": f"When pages are copied to host: {', '.join(WRITE_POLICIES)}.",
    "hicache_storage_backend": "L3 backend: tensorstore (unset: no L3).",
    "hicache_storage_spec": "L3 location: a directory, a kvstore URL (gs://bucket/dir) or a JSON spec.",
    "hicache_storage_prefetch_policy": f"When to stop waiting for L3: {', '.join(PREFETCH_POLICIES)}.",
    "hicache_prefetch_threshold": "Shortest L3 hit (tokens) worth a prefetch.",
    "hicache_host_rate_limit": "Largest share of the host pool that in-flight prefetches may hold.",
    "hicache_storage_timeout_s": (
        "Deadline (s) of every L3 call; also the longest /flush_cache and shutdown wait for L3."
    ),
    "hicache_storage_write_queue_mb": "Most page data (MB) queued for L3 writes; more backups are skipped.",
    "hicache_storage_max_gb": "L3 size cap (GB) for all servers on the store, kept by LRU eviction; 0: none.",
    "hicache_storage_min_free_gb": "Evict L3 pages when the file store's disk has less free (GB); 0: none.",
    "hicache_storage_evict_ratio": "Eviction goes down to this share of the cap (or to floor / ratio free).",
}


class FlagError(ValueError):
    """Invalid or contradictory flags; the message names them."""


def _kind(tp) -> str:
    """'bool' | 'int' | 'float' | 'str' for a field's resolved type (``int | None`` -> int)."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    base = next((a for a in args if a is not type(None)), str)
    return {bool: "bool", int: "int", float: "float"}.get(base, "str")


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Define every flag on ``fv`` (names already defined there are left alone)."""
    define = {
        "bool": flags.DEFINE_bool,
        "int": flags.DEFINE_integer,
        "float": flags.DEFINE_float,
        "str": flags.DEFINE_string,
    }
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name not in fv:
            help_ = ENGINE_HELP.get(f.name, f"EngineConfig.{f.name}")
            define[_kind(hints[f.name])](f.name, f.default, help_, flag_values=fv)
    server = {
        "host": (flags.DEFINE_string, "Interface to bind; 127.0.0.1 unless you mean to serve others."),
        "port": (flags.DEFINE_integer, "TCP port."),
        "api_key": (
            flags.DEFINE_string,
            "If set, every route but /health needs 'Authorization: Bearer <key>'.",
        ),
        "served_model_name": (
            flags.DEFINE_string,
            "Model name in the OpenAI API; default: --model_path or --preset.",
        ),
        "profile_dir": (
            flags.DEFINE_string,
            "Where POST /start_profile writes jax.profiler traces; a body's output_dir must be a "
            "directory under it (default: <tmp>/hicache-jax-profile).",
        ),
    }
    defaults = ServerConfig()
    for name, (fn, help_) in server.items():
        if name not in fv:
            fn(name, getattr(defaults, name), help_, flag_values=fv)
    if "log_level" not in fv:
        flags.DEFINE_enum("log_level", defaults.log_level, LOG_LEVELS, "Log level.", flag_values=fv)
    if "platform" not in fv:
        flags.DEFINE_enum(
            "platform", defaults.platform, PLATFORMS, "JAX platform (auto: TPU > GPU > CPU).", flag_values=fv
        )


def _name_flags(message: str) -> str:
    """'page_size=3: must be ...' -> '--page_size=3: must be ...' (field names are flag names)."""
    names = sorted((f.name for f in dataclasses.fields(EngineConfig)), key=len, reverse=True)
    pattern = r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")\b"
    return re.sub(pattern, r"--\1", message)


def configs_from_flags(fv: flags.FlagValues = flags.FLAGS) -> tuple[EngineConfig, ServerConfig]:
    """Parsed flags -> configs; raises FlagError naming the offending flag."""
    kwargs = {}
    for f in dataclasses.fields(EngineConfig):
        value = fv[f.name].value
        if value == "" and f.default is None:
            value = None  # --hicache_storage_spec= unsets a value a flagfile set
        kwargs[f.name] = value
    path = kwargs["model_path"]
    if path in SHORT_NAMES:
        try:
            installed_model(path)
        except ModelNotFound as e:
            raise FlagError(str(e)) from None
    elif path and "://" not in path and not os.path.isdir(path) and not is_repo_id(path):
        if not (os.path.isfile(path) and path.endswith(".gguf")):  # a GGUF file is a checkpoint too
            msg = "no such directory, and not a Hugging Face model id (org/name)"
            raise FlagError(f"--model_path={path}: {msg}")
    try:
        engine_cfg = EngineConfig(**kwargs)
    except ConfigError as e:
        raise FlagError(_name_flags(str(e))) from None
    try:
        server_cfg = ServerConfig(
            host=fv["host"].value,
            port=fv["port"].value,
            api_key=fv["api_key"].value,
            served_model_name=fv["served_model_name"].value,
            log_level=fv["log_level"].value,
            platform=fv["platform"].value,
            profile_dir=fv["profile_dir"].value or None,
        )
    except ServerConfigError as e:
        raise FlagError(str(e)) from None
    return engine_cfg, server_cfg


def parse(argv: list[str]) -> tuple[EngineConfig, ServerConfig]:
    """Parse a command line (``argv[0]`` is the program) on fresh FlagValues; for tests and
    tools that want configs without touching the global FLAGS."""
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise FlagError(str(e)) from None
    if len(rest) > 1:
        raise FlagError(f"unexpected arguments: {rest[1:]}")
    return configs_from_flags(fv)
