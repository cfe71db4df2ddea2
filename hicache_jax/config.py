"""Engine configuration: frozen dataclasses, validated on construction. The server's absl
flags and ``LLM(**kwargs)`` both end up here, under the same names. Each field is a
``setting``: its help (the flag's help and its row in docs/flags.md), default and checks in one place."""

from __future__ import annotations

import dataclasses
import os

from hicache_jax.storage.auth import MAX_KEY_BYTES, MIN_KEY_BYTES, BadAuthKey, read_auth_key

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
SCHEDULE_POLICIES = ("fcfs", "lpm")
# --kv_cache_dtype (``models/kv_quant.py``: what each means; the peers' names are aliases).
KV_CACHE_DTYPES = (
    *("auto", "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8"),
    *("fp8", "fp8_e4m3", "fp8_e5m2", "bf16"),
)


class ConfigError(ValueError):
    """An invalid or contradictory setting; the message names it."""


def _positive_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _unset_or(check):
    return lambda v, c: v is None or check(v, c)


def _usable_key_file(path: str) -> bool:
    """Whether the page-auth key file holds a usable key (read here to check it, then dropped;
    ``engine/build.py`` reads it again for the storage tier, and nothing else keeps it)."""
    try:
        read_auth_key(path)
    except BadAuthKey:
        return False
    return True


def setting(default, help: str, *checks, shown_default: str | None = None, choices=None, show_value=True):
    """A config field with everything said about it in one place: its ``help`` (the flag's
    help and its row in docs/flags.md, ``hicache_jax/flag_table.py``), its default, and its checks.

    A check is ``(ok(value, config), "must be ...")``; ``{field}`` in the text is filled from
    the config, so a message can name the bound it was checked against (checks run in field
    order, so a check may rely on an earlier field having passed its own). ``shown_default``
    is the default as ``--helpfull`` and the table show it where the real one is None or
    derived; ``choices`` makes the flag an enum; ``show_value=False`` leaves the value out of
    the refusal."""
    meta = {
        "help": help,
        "checks": checks,
        "shown_default": shown_default,
        "choices": choices,
        "show_value": show_value,
    }
    return dataclasses.field(default=default, metadata=meta)


def check_fields(config, error: type[Exception], prefix: str = "") -> None:
    """Run every field's checks in field order; the first refusal raises ``error`` with
    ``{prefix}{field}={value!r}: must be ...``."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        for ok, why in f.metadata.get("checks", ()):
            if not ok(value, config):
                why = why.format_map(vars(config))
                if f.metadata["show_value"]:
                    raise error(f"{prefix}{f.name}={value!r}: {why}")
                raise error(f"{prefix}{f.name} {why}")


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
    (
        lambda c: bool(c.hicache_storage_auth_key_file) and not c.hicache_storage_backend,
        "hicache_storage_auth_key_file is set but hicache_storage_backend is not",
    ),
    (
        lambda c: c.disaggregation_mode != "null" and not c.hicache_storage_backend,
        "disaggregation_mode prefill or decode hands KV over through L3: it needs "
        "--hicache_storage_backend and --hicache_storage_spec (the store both servers share)",
    ),
)

_BACKENDS = (lambda v, c: v in (None, "xla", "pallas"), "must be xla or pallas")
_AT_LEAST_1 = (lambda v, c: v >= 1, "must be >= 1")
_NOT_NEGATIVE = (lambda v, c: v >= 0, "must be >= 0")
_POSITIVE = (lambda v, c: v > 0, "must be > 0")
_SHARE = (lambda v, c: 0 < v <= 1, "must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = setting(
        None,
        "HF or orbax (hicache_jax.convert) model directory, a llama.cpp .gguf file, or a Hugging Face "
        "model id (org/name) fetched into the Hub cache (HF_HOME, HF_HUB_OFFLINE; docs/models.md: "
        "Hugging Face model ids); unset: the built-in --preset.",
        shown_default="unset",
    )
    revision: str | None = setting(
        None, "Hub branch, tag or commit of a --model_path model id.", shown_default="main"
    )
    preset: str = setting(
        "tiny",
        "Built-in random-weight preset when --model_path is unset: tiny, tiny-swa, tiny-mamba, "
        "tiny-qwen3.5, tiny-qwen3-next, tiny-moe, tiny-gpt-oss, tiny-nemotron-h, tiny-granite-h, "
        "tiny-mla, tiny-dsa, tiny-dsv4, 100m, 100m-gdn, 100m-moe, 100m-mla, 100m-dsv4 "
        "(--page_size a multiple of 16 for tiny-dsv4, of 128 for 100m-dsv4).",
    )
    dtype: str = setting(
        "auto",
        "Weights and KV dtype: auto (the checkpoint's), float32, bfloat16, float16.",
        (
            lambda v, c: v in ("auto", "float32", "bfloat16", "float16"),
            "must be auto, float32, bfloat16 or float16",
        ),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV page dtype in every tier (L1, L2, L3): auto (the model's), bfloat16, float16, float32, "
        "float8_e4m3fn, float8_e5m2 or int8 (8-bit: half bfloat16's bytes; one scale per layer "
        "and tensor: 1 for fp8, calibrated at start-up for int8). SGLang's and vLLM's names fp8, "
        "fp8_e4m3, fp8_e5m2 and bf16 are accepted (docs/kv_quantization.md).",
        (
            lambda v, c: v not in ("fp4_e2m1", "fp8_inc", "fp8_ds_mla"),
            "is not supported (4-bit KV, Gaudi's fp8 and DeepSeek's packed fp8 MLA layout); "
            "use fp8_e4m3, fp8_e5m2 or int8",
        ),
        (lambda v, c: v in KV_CACHE_DTYPES, "must be one of " + ", ".join(KV_CACHE_DTYPES)),
    )
    page_size: int = setting(
        16,
        "Tokens per KV page (a power of two); also the L3 page.",
        (lambda v, c: _positive_pow2(v), "must be a power of two"),
    )
    chunked_prefill_size: int = setting(
        512,
        "Most prompt tokens prefilled per step (a multiple of --page_size).",
        (lambda v, c: v >= c.page_size, "must be >= page_size ({page_size})"),
        (lambda v, c: v % c.page_size == 0, "must be a multiple of page_size ({page_size})"),
    )
    max_running_requests: int = setting(32, "Most requests in the running batch.", _AT_LEAST_1)
    max_total_tokens: int = setting(
        65536,
        "Device KV capacity in tokens (the full-attention page pool).",
        (lambda v, c: v >= c.page_size, "must hold at least one page"),
    )
    swa_full_tokens_ratio: float = setting(
        1.0, "Sliding-window page pool size relative to the full pool, in (0, 1].", _SHARE
    )
    mamba_cache_slots: int | None = setting(
        None,
        "Mamba state slots (working states + snapshots), at least 2 x --max_running_requests.",
        (_unset_or(lambda v, c: v >= 2 * c.max_running_requests), "must be >= 2 x max_running_requests"),
        shown_default="4 x --max_running_requests",
    )
    max_queued_tokens: int | None = setting(
        None,
        "Most prompt tokens waiting to run; beyond it a request gets 503 (retry later).",
        (_unset_or(lambda v, c: v >= 1), "must be >= 1"),
        shown_default="16 x --max_total_tokens",
    )
    context_length: int | None = setting(
        None,
        "Longest prompt + completion.",
        shown_default="the model's max_position_embeddings",
    )
    disable_radix_cache: bool = setting(False, "Turn off prefix caching.")
    disable_overlap_schedule: bool = setting(
        False, "Read each step's results before scheduling the next (docs/serving.md: Performance)."
    )
    schedule_policy: str = setting(
        "fcfs",
        "Queue order: fcfs (arrival), or lpm (longest cached prefix first, L2 and L3 included; "
        "a request waiting 64 steps goes first, and queues over 128 fall back to fcfs).",
        (lambda v, c: v in SCHEDULE_POLICIES, f"must be one of {SCHEDULE_POLICIES}"),
    )
    speculative_algorithm: str | None = setting(
        None,
        "Speculative decoding: NGRAM (drafts from the request's own tokens: prompt lookup), or "
        "NEXTN (EAGLE: its SGLang alias) drafting with the model's multi-token-prediction blocks "
        "(DeepSeek V3/V3.2, GLM-5, Qwen3-Next, Qwen3.5), or EAGLE3 with the draft checkpoint at "
        "--speculative_draft_model_path. Unset: off. STANDALONE is refused as not supported yet.",
        (
            lambda v, c: v is None or v.upper() in ("NGRAM", "NEXTN", "EAGLE", "EAGLE3"),
            "must be NGRAM, NEXTN, EAGLE or EAGLE3 (STANDALONE is not supported yet)",
        ),
        shown_default="unset",
    )
    speculative_num_steps: int | None = setting(
        None,
        "Draft tokens per request per step (SGLang's name); --speculative_num_draft_tokens is "
        "this plus one when unset.",
        (_unset_or(lambda v, c: v >= 1), "must be >= 1"),
        shown_default="unset",
    )
    speculative_num_draft_tokens: int | None = setting(
        None,
        "Tokens a request feeds per verify step: its last token and up to this minus one draft "
        "tokens (SGLang's name). Unset: --speculative_num_steps + 1, or 4.",
        (_unset_or(lambda v, c: 2 <= v <= 64), "must be in 2..64"),
        shown_default="unset",
    )
    speculative_draft_model_path: str | None = setting(
        None,
        "The EAGLE-3 draft checkpoint (LlamaForCausalLMEagle3: a local folder or a Hub id) for "
        "--speculative_algorithm EAGLE3, which needs it; other algorithms take none.",
        (
            lambda v, c: (v is not None) == ((c.speculative_algorithm or "").upper() == "EAGLE3"),
            "must be set with speculative_algorithm EAGLE3 (its draft checkpoint) and only then: "
            "other draft models are not supported yet",
        ),
        shown_default="unset",
    )
    speculative_verify_overhead_rows: float | None = setting(
        None,
        "A step's fixed cost in token rows, which decides when drafts pay for a verify step's extra "
        "rows (hicache_jax/scheduler/draft_policy.py). Unset: 12 on CPU (measured on 2 cores), 240 "
        "on an accelerator (the rows at which a bfloat16 step's compute matches reading its "
        "weights on a TPU v5e: 197 TFLOP/s over 819 GB/s); 0: verify whenever drafts are expected "
        "to gain a token.",
        (_unset_or(lambda v, c: v >= 0), "must be >= 0"),
        shown_default="unset",
    )
    speculative_ngram_min_match_window_size: int = setting(
        3,
        "NGRAM: the shortest suffix of a request's tokens looked up (SGLang's default is 1; "
        "shorter suffixes draft more often and are rejected more: benchmarks/RESULTS.md).",
        _AT_LEAST_1,
    )
    speculative_ngram_max_match_window_size: int = setting(
        12,
        "NGRAM: the longest suffix looked up (the longest that matches earlier tokens wins).",
        (
            lambda v, c: v >= c.speculative_ngram_min_match_window_size,
            "must be >= speculative_ngram_min_match_window_size ({speculative_ngram_min_match_window_size})",
        ),
    )
    attention_backend: str | None = setting(
        None,
        "Attention kernels: xla (the reference; the default off TPU) or pallas (the TPU default; "
        "elsewhere only with --kernel_interpret).",
        _BACKENDS,
        shown_default="platform's",
    )
    ssd_backend: str | None = setting(
        None,
        "Recurrent kernels (Mamba2 SSD scan, Gated DeltaNet): xla or pallas, defaults as for "
        "--attention_backend.",
        _BACKENDS,
        shown_default="platform's",
    )
    kernel_interpret: bool = setting(False, "Run Pallas kernels in interpret mode (CPU testing).")
    random_seed: int = setting(0, "Seed for preset weights and for requests without a sampling seed.")
    tp_size: int = setting(
        1,
        "Tensor-parallel degree: a mesh of the first tp_size devices, of all hosts together with "
        "--dist_num_processes > 1 (docs/tpu.md: Tensor parallel).",
        _AT_LEAST_1,
    )
    # Several processes (hosts) on one mesh, joined by jax.distributed (hicache_jax/multihost/distributed.py).
    dist_coordinator: str | None = setting(
        None,
        "host:port of process 0 when several processes (hosts) share one mesh (jax.distributed).",
        # <= 1: a bad dist_num_processes is refused by its own check, which comes next
        (
            lambda v, c: c.dist_num_processes <= 1 or bool(v),
            "must be set (host:port of process 0) when dist_num_processes > 1",
        ),
        shown_default="unset",
    )
    dist_num_processes: int = setting(
        1,
        "Processes (hosts) sharing the mesh, each started with the same flags; 1: this process alone.",
        _AT_LEAST_1,
    )
    dist_process_id: int = setting(
        0,
        "This process's index in [0, --dist_num_processes); process 0 serves HTTP.",
        (
            lambda v, c: 0 <= v < c.dist_num_processes,
            "must be in [0, dist_num_processes={dist_num_processes})",
        ),
    )
    warmup: bool = setting(
        False,
        "Compile every program serving can run before serving, so no request waits for a compile "
        "(docs/serving.md: Warm-up).",
    )
    compilation_cache_dir: str = setting(
        "auto",
        "JAX's persistent compilation cache, so a second start loads the programs the first compiled: "
        "a directory (or gs:// path); auto: JAX's own if set (JAX_COMPILATION_CACHE_DIR), else "
        "~/.cache/hicache-jax/jax ($XDG_CACHE_HOME honoured); none: off. The first engine of a "
        "process sets it.",
    )
    # Hierarchical cache (L2 host memory, L3 storage).
    enable_hierarchical_cache: bool = setting(
        False, "Copy device pages to host memory (L2) and, with a backend, storage (L3)."
    )
    hicache_ratio: float = setting(2.0, "Host pool size as a multiple of the device pool.", _POSITIVE)
    hicache_size_gb: float = setting(
        0.0, "Host pool size in GB (overrides --hicache_ratio when > 0).", _NOT_NEGATIVE
    )
    hicache_layerwise_pages: int = setting(
        -1,
        "Pages per page group a step takes from host memory layer by layer, each layer's copy "
        "overlapping the layers before it; the rest load before the step. 0: all before the "
        "step; -1: chunked_prefill_size / page_size on TPU and GPU, 0 on CPU (no copy to hide).",
        (lambda v, c: v >= -1, "must be >= -1"),
        (
            lambda v, c: v <= 0 or c.dist_num_processes == 1,
            "must be 0 or -1 over several processes (each would need the same host arrays)",
        ),
    )
    hicache_write_policy: str = setting(
        "write_through",
        f"When pages are copied to host: {', '.join(WRITE_POLICIES)}.",
        (lambda v, c: v in WRITE_POLICIES, f"must be one of {WRITE_POLICIES}"),
    )
    hicache_storage_backend: str | None = setting(
        None,
        "L3 backend: tensorstore (unset: no L3).",
        (lambda v, c: v in (None, "tensorstore"), "must be tensorstore (or unset)"),
        shown_default="unset",
    )
    hicache_storage_spec: str | None = setting(
        None,
        "L3 location: a directory, a kvstore URL (gs://bucket/dir) or a JSON kvstore spec.",
        shown_default="unset",
    )
    hicache_storage_prefetch_policy: str = setting(
        "timeout",
        f"When to stop waiting for L3: {', '.join(PREFETCH_POLICIES)}.",
        (lambda v, c: v in PREFETCH_POLICIES, f"must be one of {PREFETCH_POLICIES}"),
    )
    hicache_prefetch_threshold: int = setting(
        256, "Shortest L3 hit (tokens) worth a prefetch.", _NOT_NEGATIVE
    )
    hicache_host_rate_limit: float = setting(
        0.5, "Largest share of the host pool that in-flight prefetches may hold.", _SHARE
    )
    hicache_storage_timeout_s: float = setting(
        5.0,
        "Deadline (s) of every L3 call; also the longest /flush_cache and shutdown wait for L3.",
        _POSITIVE,
    )
    hicache_storage_write_queue_mb: float = setting(
        256.0,
        "Most page data (MB) queued for L3 writes; beyond it backups are skipped and counted.",
        _POSITIVE,
    )
    hicache_storage_max_gb: float = setting(
        0.0,
        "L3 size cap (GB, 1e9 bytes) for all servers on the store, kept by LRU eviction; 0: none.",
        _NOT_NEGATIVE,
    )
    hicache_storage_min_free_gb: float = setting(
        0.0, "Evict L3 pages when the file store's disk has less free (GB); 0: none.", _NOT_NEGATIVE
    )
    hicache_storage_evict_ratio: float = setting(
        0.9,
        "Eviction goes down to this share of --hicache_storage_max_gb (and up to "
        "--hicache_storage_min_free_gb / this ratio free).",
        _SHARE,
    )
    hicache_storage_auth_key_file: str | None = setting(
        None,
        "File holding a secret key (>= 16 bytes; surrounding whitespace ignored): every L3 page "
        "carries an HMAC-SHA256 under it, and a page that fails it is a miss (l3_corrupt_auth). "
        "Servers with other keys or none never share pages with this one. Unset: the store is trusted.",
        (
            lambda v, c: v is None or (os.path.isfile(v) and os.access(v, os.R_OK)),
            "must be a readable file (holding the L3 page-auth key)",
        ),
        (
            lambda v, c: v is None or _usable_key_file(v),
            f"must hold a key of {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, surrounding whitespace "
            "ignored (e.g. openssl rand -hex 32 > FILE)",
        ),
        shown_default="unset",
    )

    # Prefill/decode disaggregation through L3 (server/disaggregation.py).
    disaggregation_mode: str = setting(
        "null",
        "SGLang's server role behind sglang-router --pd-disaggregation: prefill computes each "
        "prompt, writes its pages through to L3 and publishes a handover marker under the "
        "request's bootstrap_room; decode waits for the marker, loads the pages as an L3 hit and "
        "decodes (computing the prompt itself if none comes in time). null: both.",
        (lambda v, c: v in DISAGGREGATION_MODES, f"must be one of {DISAGGREGATION_MODES}"),
        (
            lambda v, c: v != "prefill" or c.hicache_write_policy == "write_through",
            "must come with --hicache_write_policy=write_through (a prompt's pages must reach L3 as soon "
            "as they are computed)",
        ),
        choices=DISAGGREGATION_MODES,
    )
    disaggregation_wait_s: float = setting(
        60.0,
        "Decode role: how long a request waits for its handover marker before it computes the "
        "prompt itself (counted in /metrics as hicache_pd_fallbacks_total). A prefill server "
        "waits at most 3 x --hicache_storage_timeout_s for a prompt's pages to reach L3.",
        _POSITIVE,
    )

    def __post_init__(self):
        check_fields(self, ConfigError)
        for contradiction, why in COMBINATION_RULES:
            if contradiction(self):
                raise ConfigError(why)

    @property
    def queued_token_limit(self) -> int:
        return self.max_queued_tokens or 16 * self.max_total_tokens

    @property
    def spec_width(self) -> int:
        """Tokens a request feeds per verify step (0: no speculative decoding)."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens
        return self.speculative_num_steps + 1 if self.speculative_num_steps else 4

    @property
    def num_state_slots(self) -> int:
        """Recurrent state slots: working slots, snapshots, and a verify step's scratch
        slots (one per draft token of each running request)."""
        scratch = max(self.spec_width - 1, 0) * self.max_running_requests
        return self.mamba_cache_slots or 4 * self.max_running_requests + scratch

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# Every field check as (field, ok, why), in the order they run; derived from the fields.
FIELD_RULES = tuple(
    (f.name, ok, why) for f in dataclasses.fields(EngineConfig) for ok, why in f.metadata["checks"]
)
