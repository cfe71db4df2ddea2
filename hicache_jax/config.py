"""Engine configuration: frozen dataclasses, validated on construction. The server's absl
flags and ``LLM(**kwargs)`` both end up here, under the same names."""

from __future__ import annotations

import dataclasses

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SCHEDULE_POLICIES = ("fcfs", "lpm")


class ConfigError(ValueError):
    """An invalid or contradictory setting; the message names it."""


def _positive_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _unset_or(check):
    return lambda v, c: v is None or check(v, c)


# One rule per entry: (field, ok(value, config), what it must be). ``{field}`` in the text
# is filled from the config, so a message can name the bound it was checked against.
FIELD_RULES = (
    ("page_size", lambda v, c: _positive_pow2(v), "must be a power of two"),
    ("chunked_prefill_size", lambda v, c: v >= c.page_size, "must be >= page_size ({page_size})"),
    (
        "chunked_prefill_size",
        lambda v, c: v % c.page_size == 0,
        "must be a multiple of page_size ({page_size})",
    ),
    ("max_running_requests", lambda v, c: v >= 1, "must be >= 1"),
    ("max_total_tokens", lambda v, c: v >= c.page_size, "must hold at least one page"),
    ("swa_full_tokens_ratio", lambda v, c: 0 < v <= 1.0, "must be in (0, 1]"),
    (
        "dtype",
        lambda v, c: v in ("auto", "float32", "bfloat16", "float16"),
        "must be auto, float32, bfloat16 or float16",
    ),
    ("attention_backend", lambda v, c: v in (None, "xla", "pallas"), "must be xla or pallas"),
    ("ssd_backend", lambda v, c: v in (None, "xla", "pallas"), "must be xla or pallas"),
    ("tp_size", lambda v, c: v >= 1, "must be >= 1"),
    ("schedule_policy", lambda v, c: v in SCHEDULE_POLICIES, f"must be one of {SCHEDULE_POLICIES}"),
    ("dist_num_processes", lambda v, c: v >= 1, "must be >= 1"),
    (
        "dist_process_id",
        lambda v, c: 0 <= v < c.dist_num_processes,
        "must be in [0, dist_num_processes={dist_num_processes})",
    ),
    (
        "dist_coordinator",
        lambda v, c: c.dist_num_processes == 1 or bool(v),
        "must be set (host:port of process 0) when dist_num_processes > 1",
    ),
    ("hicache_ratio", lambda v, c: v > 0, "must be > 0"),
    ("hicache_size_gb", lambda v, c: v >= 0, "must be >= 0"),
    ("hicache_write_policy", lambda v, c: v in WRITE_POLICIES, f"must be one of {WRITE_POLICIES}"),
    (
        "hicache_storage_prefetch_policy",
        lambda v, c: v in PREFETCH_POLICIES,
        f"must be one of {PREFETCH_POLICIES}",
    ),
    ("hicache_storage_backend", lambda v, c: v in (None, "tensorstore"), "must be tensorstore (or unset)"),
    ("hicache_prefetch_threshold", lambda v, c: v >= 0, "must be >= 0"),
    ("hicache_host_rate_limit", lambda v, c: 0 < v <= 1, "must be in (0, 1]"),
    ("hicache_storage_timeout_s", lambda v, c: v > 0, "must be > 0"),
    ("hicache_storage_write_queue_mb", lambda v, c: v > 0, "must be > 0"),
    ("hicache_storage_max_gb", lambda v, c: v >= 0, "must be >= 0"),
    ("hicache_storage_min_free_gb", lambda v, c: v >= 0, "must be >= 0"),
    ("hicache_storage_evict_ratio", lambda v, c: 0 < v <= 1, "must be in (0, 1]"),
    ("max_queued_tokens", _unset_or(lambda v, c: v >= 1), "must be >= 1"),
    (
        "mamba_cache_slots",
        _unset_or(lambda v, c: v >= 2 * c.max_running_requests),
        "must be >= 2 x max_running_requests",
    ),
)

# Settings that contradict each other: (contradiction(config), message).
COMBINATION_RULES = (
    (
        lambda c: bool(c.hicache_storage_backend) and not c.enable_hierarchical_cache,
        "hicache_storage_backend requires enable_hierarchical_cache (L3 is filled from L2)",
    ),
    (
        lambda c: c.enable_hierarchical_cache and c.disable_radix_cache,
        "enable_hierarchical_cache contradicts disable_radix_cache",
    ),
    (
        lambda c: bool(c.hicache_storage_spec) and not c.hicache_storage_backend,
        "hicache_storage_spec is set but hicache_storage_backend is not",
    ),
)


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
    schedule_policy: str = "fcfs"  # fcfs | lpm: longest cached prefix first (scheduler/scheduler.py)
    attention_backend: str | None = None  # xla | pallas; None: platform default
    ssd_backend: str | None = None
    kernel_interpret: bool = False  # Pallas interpret mode (CPU tests)
    random_seed: int = 0
    tp_size: int = 1  # tensor-parallel degree: a mesh of the first tp_size devices
    # Several processes (hosts) on one mesh, joined by jax.distributed (hicache_jax/multihost/distributed.py).
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
        for name, ok, why in FIELD_RULES:
            value = getattr(self, name)
            if not ok(value, self):
                raise ConfigError(f"{name}={value!r}: {why.format_map(vars(self))}")
        for contradiction, why in COMBINATION_RULES:
            if contradiction(self):
                raise ConfigError(why)

    @property
    def queued_token_limit(self) -> int:
        return self.max_queued_tokens or 16 * self.max_total_tokens

    @property
    def num_state_slots(self) -> int:
        return self.mamba_cache_slots or 4 * self.max_running_requests

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
