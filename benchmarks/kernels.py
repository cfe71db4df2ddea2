"""Ragged paged attention (Pallas) against its byte floor.

The floor is the bytes a call must move (the K/V each sequence's queries can see, the queries
once, the output once) divided by the copy bandwidth measured in the same run, so the printed
ratio says how far the kernel is from memory-bound. The kernel is a Mosaic (TPU) kernel: on a
GPU the ``xla`` reference is timed against the same floor instead; on CPU the kernel runs in
interpret mode at a small size as a correctness check, and timings need an accelerator.

    python benchmarks/kernels.py
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/ is the script dir)

from hicache_jax.models.kernels.ragged_paged_attention import kernel, reference


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence
    page_size: int = 64
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    window: int | None = None
    dtype: str = "bfloat16"


def _decode(n: int, kv_len: int) -> tuple[tuple[int, int], ...]:
    return ((1, kv_len),) * n


ACCEL_CASES = (
    Case("decode 64 x 4096", _decode(64, 4096)),
    Case("decode 64 x 4096, window 1024", _decode(64, 4096), window=1024),
    Case("decode 64 x 4096, page 16", _decode(64, 4096), page_size=16),
    Case("mixed 4 x 512-chunk + 60 decode", ((512, 2048),) * 4 + _decode(60, 4096)),
    Case("prefill 4 x 2048", ((2048, 2048),) * 4),
)
CPU_CASES = (
    Case("mixed", ((1, 70), (30, 30), (20, 150), (1, 33)), 16, 8, 2, 32, None, "float32"),
    Case("mixed, window 17", ((1, 70), (30, 30), (20, 150)), 16, 8, 2, 32, 17, "float32"),
    Case("mixed, window 100", ((1, 70), (30, 30), (20, 150)), 64, 4, 4, 32, 100, "bfloat16"),
)


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Random queries and pages; each sequence owns a shuffled run of pool pages."""
    rng = np.random.default_rng(seed)
    ps, S = case.page_size, len(case.seqs)
    max_pages = max(-(-kv // ps) for _, kv in case.seqs)
    num_pages = S * max_pages
    T = sum(q for q, _ in case.seqs)
    key = jax.random.split(jax.random.key(seed), 3)
    pool = (num_pages, ps, case.num_kv_heads, case.head_dim)
    return dict(
        q=jax.random.normal(key[0], (T, case.num_q_heads, case.head_dim), case.dtype),
        k_pages=jax.random.normal(key[1], pool, case.dtype),
        v_pages=jax.random.normal(key[2], pool, case.dtype),
        kv_lens=jnp.array([kv for _, kv in case.seqs], jnp.int32),
        page_tables=jnp.asarray(rng.permutation(num_pages).reshape(S, max_pages), jnp.int32),
        cu_q_lens=jnp.array(np.cumsum([0] + [q for q, _ in case.seqs]), jnp.int32),
        num_seqs=jnp.int32(S),
    )


def floor_bytes(case: Case) -> int:
    """K and V tokens some query sees (token-exact, below page granularity), q and out once."""
    item = jnp.dtype(case.dtype).itemsize
    kv_tokens = 0
    for q_len, kv_len in case.seqs:
        lo = max(0, kv_len - q_len - case.window + 1) if case.window else 0
        kv_tokens += kv_len - lo
    q_tokens = sum(q for q, _ in case.seqs)
    return item * case.head_dim * (2 * kv_tokens * case.num_kv_heads + 2 * q_tokens * case.num_q_heads)


def _median_seconds(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _static(case: Case) -> dict:
    return dict(sm_scale=case.head_dim**-0.5, sliding_window=case.window)


def time_case(case: Case, fn, bandwidth: float) -> str:
    inputs = make_inputs(case)
    secs = _median_seconds(lambda: fn(**inputs, **_static(case)))
    floor = floor_bytes(case) / bandwidth
    return f"{case.name:<36} {secs * 1e3:8.3f} ms   floor {floor * 1e3:7.3f} ms   {secs / floor:6.2f}x"


def check_interpret(case: Case) -> str:
    inputs = make_inputs(case)
    want = reference.ragged_paged_attention(**inputs, **_static(case))
    got = kernel.ragged_paged_attention(**inputs, **_static(case), interpret=True)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    return f"{case.name:<36} {case.dtype:<9} max |pallas - reference| = {err:.2e}"


def bench_attention() -> None:
    platform = jax.default_backend()
    if platform == "cpu":
        print("ragged paged attention: interpret-mode correctness on CPU")
        for case in CPU_CASES:
            print("  " + check_interpret(case))
        print("  timings need an accelerator (TPU for the Pallas kernel)")
        return
    bandwidth = copy_bandwidth()
    print(f"ragged paged attention on {platform}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    if platform == "tpu":
        fn, label = kernel.ragged_paged_attention, "pallas"
    else:  # the kernel is written for Mosaic TPU; time what this platform serves with
        fn, label = reference.ragged_paged_attention, "xla reference (pallas kernel is TPU-only)"
    print(f"  timing: {label}")
    for case in ACCEL_CASES:
        print("  " + time_case(case, fn, bandwidth))


def main() -> None:
    """Every kernel: ragged paged attention here, the Mamba2 SSD scan in kernel_ssd.py."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_ssd import bench_ssd

    bench_attention()
    bench_ssd()


if __name__ == "__main__":
    main()
