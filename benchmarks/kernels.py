"""Ragged paged attention (Pallas) against its byte floor.

The floor is the bytes a call must move (the K/V each sequence's queries can see, the queries
once, the output once) divided by the copy bandwidth measured in the same run, so the printed
ratio says how far the kernel is from memory-bound. The kernel is a Mosaic (TPU) kernel: on a
GPU the ``xla`` reference is timed against the same floor instead. On CPU the kernel runs in
interpret mode at a small size as a correctness check, and the ``xla`` backend (what CPU
serving runs) is timed at the 100m preset's shapes: one decode layer at batch 1 to 64, and a
prefill. Blocks are cut as the engine cuts them (``q_block`` 1 for a decode-only batch).

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
from hicache_jax.models.layers.attention import PREFILL_Q_BLOCK


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
# The 100m preset: 12 query heads over 4 KV heads of 64, float32 on CPU, 16-token pages.
_100M = dict(page_size=16, num_q_heads=12, num_kv_heads=4, head_dim=64, dtype="float32")
CPU_TIMED_CASES = tuple(Case(f"100m decode {b} x 257", _decode(b, 257), **_100M) for b in (1, 8, 32, 64)) + (
    Case("100m decode 32 x 1024, window 512", _decode(32, 1024), window=512, **_100M),
    Case("100m prefill 1 x 2048", ((2048, 2048),), **_100M),
    Case("100m prefill 1 x 2048, window 512", ((2048, 2048),), window=512, **_100M),
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


def _static(case: Case, backend: str = "xla") -> dict:
    decode = all(q == 1 for q, _ in case.seqs)
    q_block = 1 if decode else PREFILL_Q_BLOCK[backend]
    return dict(sm_scale=case.head_dim**-0.5, sliding_window=case.window, q_block=q_block)


def time_case(case: Case, fn, bandwidth: float, backend: str) -> str:
    inputs = make_inputs(case)
    secs = _median_seconds(lambda: fn(**inputs, **_static(case, backend)))
    floor = floor_bytes(case) / bandwidth
    return f"{case.name:<36} {secs * 1e3:8.3f} ms   floor {floor * 1e3:7.3f} ms   {secs / floor:6.2f}x"


def check_interpret(case: Case) -> str:
    inputs = make_inputs(case)
    want = reference.ragged_paged_attention(**inputs, **_static(case, "pallas"))
    got = kernel.ragged_paged_attention(**inputs, **_static(case, "pallas"), interpret=True)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    return f"{case.name:<36} {case.dtype:<9} max |pallas - reference| = {err:.2e}"


def bench_attention() -> None:
    platform = jax.default_backend()
    bandwidth = copy_bandwidth()
    print(f"ragged paged attention on {platform}: copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    if platform == "cpu":
        print("  pallas kernel: interpret-mode correctness (timings need a TPU)")
        for case in CPU_CASES:
            print("    " + check_interpret(case))
        print("  timing: xla backend")
        for case in CPU_TIMED_CASES:
            print("    " + time_case(case, reference.ragged_paged_attention, bandwidth, "xla"))
        return
    if platform == "tpu":
        fn, backend = kernel.ragged_paged_attention, "pallas"
    else:  # the kernel is written for Mosaic TPU; time what this platform serves with
        fn, backend = reference.ragged_paged_attention, "xla"
    print(f"  timing: {backend}")
    for case in ACCEL_CASES:
        print("  " + time_case(case, fn, bandwidth, backend))


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
