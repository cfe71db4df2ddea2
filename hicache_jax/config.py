"""Engine configuration: frozen dataclasses, validated on construction. The server's absl
flags and ``LLM(**kwargs)`` both end up here, under the same names."""

from __future__ import annotations

import dataclasses

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


class ConfigError(ValueError):
    """An invalid or contradictory setting; the message names it."""


def _require(cond: bool, name: str, why: str, value) -> None:
    if not cond:
        raise ConfigError(f"{name}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # a directory or a Hub id (org/name); None: the built-in preset
    revision: str | None = None  # Hub branch, tag or commit of a model id (None: main)
    preset: str = "tiny"
    dtype: str = "auto"  # auto | float32 | bfloat16
    page_size: int = 16
    chunked_prefill_size: int = 512
    max_running_requests: int = 32
    max_total_tokens: int = 65536  # device KV capacity (full-attention pool), tokens
    swa_full_tokens_ratio: float = 1.0  # sliding-window pool size relative to the full pool
    mamba_cache_slots: int | None = None  # default: 4 x max_running_requests
    max_queued_tokens: int | None = None  # prompt tokens waiting; default 16 x max_total_tokens
    context_length: int | None = None  # default: the model's max_position_embeddings
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False  # read each step's results before scheduling the next
    attention_backend: str | None = None  # xla | pallas; None: platform default
    ssd_backend: str | None = None
    kernel_interpret: bool = False  # Pallas interpret mode (CPU tests)
    random_seed: int = 0
    tp_size: int = 1  # tensor-parallel degree: a mesh of the first tp_size devices
    # Several processes (hosts) on one mesh, joined by jax.distributed (hicache_jax/distributed.py).
    dist_coordinator: str | None = None  # host:port of process 0
    dist_num_processes: int = 1
    dist_process_id: int = 0
    warmup: bool = False  # compile every shape bucket at start-up
    # Hierarchical cache (L2 host memory, L3 storage).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size_gb: float = 0.0  # overrides hicache_ratio when > 0
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None  # None | "tensorstore"
    hicache_storage_spec: str | None = None  # path, kvstore URL or JSON spec
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_prefetch_threshold: int = 256  # tokens; shorter L3 hits are not fetched
    hicache_host_rate_limit: float = 0.5  # max share of the host pool held by prefetches
    hicache_storage_timeout_s: float = 5.0  # deadline of each L3 call, of flush's and close's L3 waits
    hicache_storage_write_queue_mb: float = 256.0  # page bytes queued for L3; beyond, backups are skipped
    hicache_storage_max_gb: float = 0.0  # L3 size cap (1e9 bytes); 0: unbounded
    hicache_storage_min_free_gb: float = 0.0  # free-space floor of a file L3; 0: none
    hicache_storage_evict_ratio: float = 0.9  # eviction goes down to this share of the limit

    def __post_init__(self):
        r = _require
        r(
            self.page_size > 0 and self.page_size & (self.page_size - 1) == 0,
            "page_size",
            "must be a power of two",
            self.page_size,
        )
        r(
            self.chunked_prefill_size >= self.page_size,
            "chunked_prefill_size",
            f"must be >= page_size ({self.page_size})",
            self.chunked_prefill_size,
        )
        r(
            self.chunked_prefill_size % self.page_size == 0,
            "chunked_prefill_size",
            f"must be a multiple of page_size ({self.page_size})",
            self.chunked_prefill_size,
        )
        r(self.max_running_requests >= 1, "max_running_requests", "must be >= 1", self.max_running_requests)
        r(
            self.max_total_tokens >= self.page_size,
            "max_total_tokens",
            "must hold at least one page",
            self.max_total_tokens,
        )
        r(
            0 < self.swa_full_tokens_ratio <= 1.0,
            "swa_full_tokens_ratio",
            "must be in (0, 1]",
            self.swa_full_tokens_ratio,
        )
        r(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            "must be auto, float32, bfloat16 or float16",
            self.dtype,
        )
        for name in ("attention_backend", "ssd_backend"):
            v = getattr(self, name)
            r(v in (None, "xla", "pallas"), name, "must be xla or pallas", v)
        r(self.tp_size >= 1, "tp_size", "must be >= 1", self.tp_size)
        r(self.dist_num_processes >= 1, "dist_num_processes", "must be >= 1", self.dist_num_processes)
        r(
            0 <= self.dist_process_id < self.dist_num_processes,
            "dist_process_id",
            f"must be in [0, dist_num_processes={self.dist_num_processes})",
            self.dist_process_id,
        )
        r(
            self.dist_num_processes == 1 or bool(self.dist_coordinator),
            "dist_coordinator",
            "must be set (host:port of process 0) when dist_num_processes > 1",
            self.dist_coordinator,
        )
        r(self.hicache_ratio > 0, "hicache_ratio", "must be > 0", self.hicache_ratio)
        r(self.hicache_size_gb >= 0, "hicache_size_gb", "must be >= 0", self.hicache_size_gb)
        r(
            self.hicache_write_policy in WRITE_POLICIES,
            "hicache_write_policy",
            f"must be one of {WRITE_POLICIES}",
            self.hicache_write_policy,
        )
        r(
            self.hicache_storage_prefetch_policy in PREFETCH_POLICIES,
            "hicache_storage_prefetch_policy",
            f"must be one of {PREFETCH_POLICIES}",
            self.hicache_storage_prefetch_policy,
        )
        r(
            self.hicache_storage_backend in (None, "tensorstore"),
            "hicache_storage_backend",
            "must be tensorstore (or unset)",
            self.hicache_storage_backend,
        )
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ConfigError(
                "hicache_storage_backend requires enable_hierarchical_cache (L3 is filled from L2)"
            )
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("enable_hierarchical_cache contradicts disable_radix_cache")
        if self.hicache_storage_spec and not self.hicache_storage_backend:
            raise ConfigError("hicache_storage_spec is set but hicache_storage_backend is not")
        r(
            self.hicache_prefetch_threshold >= 0,
            "hicache_prefetch_threshold",
            "must be >= 0",
            self.hicache_prefetch_threshold,
        )
        r(
            0 < self.hicache_host_rate_limit <= 1,
            "hicache_host_rate_limit",
            "must be in (0, 1]",
            self.hicache_host_rate_limit,
        )
        r(
            self.hicache_storage_timeout_s > 0,
            "hicache_storage_timeout_s",
            "must be > 0",
            self.hicache_storage_timeout_s,
        )
        r(
            self.hicache_storage_write_queue_mb > 0,
            "hicache_storage_write_queue_mb",
            "must be > 0",
            self.hicache_storage_write_queue_mb,
        )
        for name in ("hicache_storage_max_gb", "hicache_storage_min_free_gb"):
            r(getattr(self, name) >= 0, name, "must be >= 0", getattr(self, name))
        r(
            0 < self.hicache_storage_evict_ratio <= 1,
            "hicache_storage_evict_ratio",
            "must be in (0, 1]",
            self.hicache_storage_evict_ratio,
        )
        if self.max_queued_tokens is not None:
            r(self.max_queued_tokens >= 1, "max_queued_tokens", "must be >= 1", self.max_queued_tokens)
        if self.mamba_cache_slots is not None:
            r(
                self.mamba_cache_slots >= 2 * self.max_running_requests,
                "mamba_cache_slots",
                "must be >= 2 x max_running_requests",
                self.mamba_cache_slots,
            )

    @property
    def queued_token_limit(self) -> int:
        return self.max_queued_tokens or 16 * self.max_total_tokens

    @property
    def num_state_slots(self) -> int:
        return self.mamba_cache_slots or 4 * self.max_running_requests

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
