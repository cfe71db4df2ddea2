"""Kernel backends behind one small registry.

``xla`` is plain JAX (the references; the default off TPU); ``pallas`` is the Pallas
kernels, written for TPU (Mosaic) and run in interpret mode on CPU by the tests. Backends
import lazily, so a CPU machine never imports TPU-only code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

BACKENDS = ("xla", "pallas")
MOE_PATHS = ("grouped", "gathered")


def default_backend() -> str:
    """``pallas`` on TPU (the kernels are written for Mosaic); ``xla`` elsewhere."""
    return "pallas" if jax.default_backend() == "tpu" else "xla"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which implementation each kernel uses. ``None`` means the platform default.

    ``mesh``: the tensor-parallel mesh (``models/sharding.py``) the kernels run on, one
    shard per device under ``shard_map``; ``None`` runs them on one device."""

    attention: str | None = None
    ssd: str | None = None
    interpret: bool = False  # run Pallas kernels in interpret mode (CPU tests)
    mesh: jax.sharding.Mesh | None = None
    # Mixture-of-experts layers (``layers/moe.py``): "grouped" (jax.lax.ragged_dot, a grouped
    # matmul on TPU and GPU) or "gathered" (CPU, where XLA lowers ragged_dot densely).
    moe: str | None = None

    def __post_init__(self):
        for field in ("attention", "ssd"):
            value = getattr(self, field)
            if value is not None and value not in BACKENDS:
                raise ValueError(f"KernelConfig.{field}={value!r}; choose one of {BACKENDS}")
        if self.moe not in (None, *MOE_PATHS):
            raise ValueError(f"KernelConfig.moe={self.moe!r}; choose one of {MOE_PATHS}")

    @property
    def moe_path(self) -> str:
        return self.moe or ("gathered" if jax.default_backend() == "cpu" else "grouped")

    @property
    def attention_backend(self) -> str:
        return self.attention or default_backend()

    def check_platform(self, platform: str | None = None) -> None:
        """Refuse, at start-up, Pallas kernels that this platform cannot run: they are
        written for TPU (Mosaic) and run elsewhere only in interpret mode. Without this, the
        first step fails deep inside JAX ("Only interpret mode is supported on CPU backend")."""
        platform = platform or jax.default_backend()
        if platform == "tpu" or self.interpret:
            return
        for flag, backend in (("attention_backend", self.attention), ("ssd_backend", self.ssd)):
            if backend == "pallas":
                raise ValueError(
                    f"--{flag}=pallas needs a TPU (its kernels are written for Mosaic); this is "
                    f"{platform}. Use --{flag}=xla, or add --kernel_interpret to run the Pallas "
                    "kernels in interpret mode (slow; meant for tests)"
                )

    @property
    def ssd_backend(self) -> str:
        """The backend of the recurrent kernels: Mamba2's SSD scan and Gated DeltaNet's."""
        return self.ssd or default_backend()

    def check_model(self, cfg, dtype, kv_dtype=None, chip: str | None = None) -> None:
        """Refuse, when the model is built (before any weight is read), a model whose
        per-shard shapes the Pallas kernels cannot compile for TPU, naming the flag and the
        value; interpret mode (CPU tests) has no such limits. Without this, the first
        compile would fail deep inside Mosaic. The kernels' own ``check_shapes`` say why.

        ``kv_dtype``: the pages' dtype (``--kv_cache_dtype``; default ``dtype``), refused
        naming that flag when the Pallas attention kernels cannot read it on ``chip``
        (``kv_dtypes.py``; default: the device's chip, none off TPU)."""
        if self.interpret:
            return
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if self.attention_backend == "pallas" and cfg.attention_layers:
            from hicache_jax.models.kernels import kv_dtypes

            kv_dtypes.check(kv_dtype, chip or kv_dtypes.current_chip())
        from hicache_jax.models.sharding import kv_heads_on_device, tp_size

        tp = tp_size(self.mesh)
        checks = []
        if self.attention_backend == "pallas" and cfg.attention_layers:
            from hicache_jax.models.kernels.ragged_paged_attention import kernel

            heads = dict(num_q_heads=cfg.num_heads // tp, num_kv_heads=kv_heads_on_device(cfg, tp) // tp)
            width = cfg.head_dim
            if getattr(cfg, "mla", None) is not None:  # one latent row every head reads, replicated
                heads, width = dict(num_q_heads=cfg.num_heads // tp, num_kv_heads=1), cfg.mla.latent_dim
            checks.append(
                (
                    "attention_backend",
                    lambda: kernel.check_shapes(**heads, head_dim=width, dtype=kv_dtype),
                )
            )
        if self.ssd_backend == "pallas" and cfg.mamba is not None and cfg.mamba_layers:
            from hicache_jax.models.kernels.mamba2_ssd import kernel as ssd

            m = cfg.mamba
            shard = (m.num_heads // tp, max(m.num_groups, tp) // tp, m.head_dim, m.state_size, dtype)
            checks.append(("ssd_backend", lambda: ssd.check_shapes(*shard)))
        gdn = getattr(cfg, "gdn", None)  # Gated DeltaNet layers (Qwen3-Next, Qwen3.5)
        if self.ssd_backend == "pallas" and gdn is not None and getattr(cfg, "gdn_layers", ()):
            from hicache_jax.models.kernels.gated_delta_rule import kernel as gdn_kernel

            gdn_shard = (gdn.num_v_heads // tp, gdn.head_k_dim, gdn.head_v_dim, dtype)
            checks.append(("ssd_backend", lambda: gdn_kernel.check_shapes(*gdn_shard)))
        for flag, check in checks:
            try:
                check()
            except ValueError as e:
                raise ValueError(
                    f"--{flag}=pallas cannot run {cfg.architecture} at tp_size={tp}: {e}"
                ) from None


@functools.cache
def attention_fn(backend: str, interpret: bool = False) -> Callable:
    """``fn(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, num_seqs, **static)``."""
    if backend == "xla":
        from hicache_jax.models.kernels.ragged_paged_attention.reference import (
            ragged_paged_attention,
        )

        return ragged_paged_attention
    if backend == "pallas":
        from hicache_jax.models.kernels.ragged_paged_attention import kernel

        return functools.partial(kernel.ragged_paged_attention, interpret=interpret)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


@functools.cache
def row_attention_fn(backend: str, interpret: bool = False) -> Callable:
    """Attention over per-token row lists of a paged pool (DeepSeek V4's window and
    compressed entries): ``fn(q, pages, table, seq, idx, *, sm_scale) -> (o, lse)``."""
    if backend == "xla":
        from hicache_jax.models.kernels.paged_row_attention.reference import paged_row_attention

        return paged_row_attention
    if backend == "pallas":
        from hicache_jax.models.kernels.paged_row_attention import kernel

        return functools.partial(kernel.paged_row_attention, interpret=interpret)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


@functools.cache
def index_scores_fn(backend: str, interpret: bool = False) -> Callable | None:
    """A lightning indexer's scores over a paged key pool (DeepSeek V4's CSA, DSA):
    ``fn(q, w, keys, table, seq, last) -> [T, N]`` float32 for the ``pallas`` backend;
    ``None`` for ``xla``, whose caller (``layers/mla.py`` ``top_k_rows``) scores in blocks
    into a running top-k."""
    if backend == "xla":
        return None
    if backend == "pallas":
        from hicache_jax.models.kernels.index_scores import kernel

        return functools.partial(kernel.index_scores, interpret=interpret)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


@functools.cache
def kv_write_fn(backend: str, interpret: bool = False) -> Callable:
    """``fn(k_pages, v_pages, k, v, slot_mapping) -> (k_pages, v_pages)``."""
    if backend == "xla":
        from hicache_jax.models.kernels.ragged_paged_attention.reference import write_kv

        return write_kv
    if backend == "pallas":
        from hicache_jax.models.kernels.ragged_paged_attention import kv_write

        return functools.partial(kv_write.write_kv, interpret=interpret)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


@functools.cache
def ssd_fn(backend: str, interpret: bool = False, decode: bool = False) -> Callable:
    """Slot-indexed SSD scan (``decode``: the one-token update of a decode-only batch):
    ``fn(x, dt, A, B, C, D, cu_seqlens, num_seqs, states, slots, has_initial_state)
    -> (y, updated_states)``."""
    if backend == "xla":
        from hicache_jax.models.kernels.mamba2_ssd import chunked

        return chunked.ssd_decode_slots if decode else chunked.ssd_slots
    if backend == "pallas":
        from hicache_jax.models.kernels.mamba2_ssd import decode_kernel, kernel

        fn = decode_kernel.ssd_decode if decode else kernel.ssd_ragged
        return functools.partial(fn, interpret=interpret)
    raise ValueError(f"unknown ssd backend {backend!r}; choose one of {BACKENDS}")


@functools.cache
def gdn_fn(backend: str, interpret: bool = False, decode: bool = False) -> Callable:
    """Slot-indexed Gated DeltaNet (``decode``: the one-token update of a decode-only batch):
    ``fn(q, k, v, g, beta, cu_seqlens, num_seqs, states, slots, has_initial_state)
    -> (o, updated_states)``. Chosen by the same flag as the SSD scan (``ssd_backend``)."""
    if backend == "xla":
        from hicache_jax.models.kernels.gated_delta_rule import chunked

        return chunked.gdn_decode_slots if decode else chunked.gdn_slots
    if backend == "pallas":
        from hicache_jax.models.kernels.gated_delta_rule import decode_kernel, kernel

        fn = decode_kernel.gdn_decode if decode else kernel.gdn_ragged
        return functools.partial(fn, interpret=interpret)
    raise ValueError(f"unknown ssd backend {backend!r}; choose one of {BACKENDS}")
