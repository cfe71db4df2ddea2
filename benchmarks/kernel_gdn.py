"""Gated DeltaNet kernels against their floors.

Prefill (the chunked form at one prefill chunk) against its compute floor: the FLOPs of the
chunked algorithm (``chunked_flops``) divided by the matmul rate measured in the same run
(``floors.matmul_rate``). Decode (one token per sequence) against its byte floor: each
sequence's state read and written once plus its token (``decode_bytes``) divided by the copy
bandwidth measured in the same run (``bandwidth.copy_bandwidth``). On CPU the xla backend
(``chunked.gdn_slots``, ``chunked.gdn_decode_slots``) is timed and the Pallas kernels are only
checked in interpret mode at a small size; on TPU the Pallas kernels are timed too.

    python benchmarks/kernel_gdn.py
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/ is the script dir)
from floors import matmul_rate  # noqa: E402

from hicache_jax.models.kernels.gated_delta_rule import chunked, decode_kernel, kernel, reference

F32 = jnp.float32


def _timeit(step, carry, reps: int = 10) -> float:
    """Median seconds of ``carry = step(carry)`` (the state pool is threaded through, donated)."""
    carry = jax.block_until_ready(step(carry))  # compile + warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_inputs(key, *, T, S, H, Dk, Dv, dtype, num_slots):
    """S equal sequences over T rows, every one continuing from a carried-in state."""
    ks = jax.random.split(key, 6)
    q = reference.l2norm(jax.random.normal(ks[0], (T, H, Dk))) * Dk**-0.5  # [T, H, Dk]
    k = reference.l2norm(jax.random.normal(ks[1], (T, H, Dk)))  # [T, H, Dk]
    v = jax.random.normal(ks[2], (T, H, Dv), dtype)  # [T, H, Dv]
    g = -jnp.exp(jax.random.normal(ks[3], (T, H), F32) - 3.0)  # [T, H]
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (T, H), F32))  # [T, H]
    cu = jnp.arange(S + 1, dtype=jnp.int32) * (T // S)  # [S + 1]
    states = 0.1 * jax.random.normal(ks[5], (num_slots, H, Dk, Dv), F32)  # [num_slots, H, Dk, Dv]
    head = (q.astype(dtype), k.astype(dtype), v, g, beta, cu, jnp.int32(S))
    return head, states, (jnp.arange(S, dtype=jnp.int32), jnp.ones((S,), bool))


def chunked_flops(T: int, H: int, Dk: int, Dv: int, Q: int, inverse: bool = False) -> float:
    """FLOPs of the chunked algorithm over T rows (whole chunks), per chunk and head: k k^T and
    q k^T (2 Q^2 Dk each), the unit-triangular solves for u and w (Q^2 per right-hand column),
    the state read by w and q and its update (2 Q Dk Dv each), the chunk's attention on v_new
    (2 Q^2 Dv). The exps and masks are elementwise and not counted. ``inverse``: as the code
    does it, the system inverted by block doubling (2 Q^3 matmuls per level, log2 Q levels)
    and applied to v and k by matmuls (2 Q^2 per column) instead of solved."""
    solve = Q * Q * (Dk + Dv)
    if inverse:
        solve = 4 * Q**3 * max(Q - 1, 0).bit_length() + 2 * Q * Q * (Dk + Dv)
    per_chunk = 4 * Q * Q * Dk + solve + 2 * Q * Q * Dv + 6 * Q * Dk * Dv
    return -(-T // Q) * H * per_chunk


def decode_bytes(S: int, H: int, Dk: int, Dv: int, itemsize: int) -> int:
    """Bytes a decode step must move: each state read and written once (f32), q, k, v, g,
    beta in and o (f32) out."""
    return 2 * S * H * Dk * Dv * 4 + S * H * ((2 * Dk + Dv) * itemsize + 8 + Dv * 4)


def run_case(name, fn, shape, dtype, floor_s, floor_what, **static) -> None:
    T, S, H, Dk, Dv = (shape[k] for k in ("T", "S", "H", "Dk", "Dv"))
    head, states, tail = make_inputs(jax.random.key(0), **shape, dtype=dtype, num_slots=S)
    call = jax.jit(functools.partial(fn, **static), donate_argnums=7)
    step = lambda st: call(*head, st, *tail)[1]
    secs = _timeit(step, states)
    print(
        f"{name:<48} {secs * 1e3:9.3f} ms   {floor_what} floor {floor_s * 1e3:8.3f} ms   "
        f"{secs / floor_s:6.2f}x floor"
    )


def check_interpret() -> None:
    """Small correctness check of both kernels in interpret mode (no accelerator needed)."""
    shape = dict(T=48, S=3, H=4, Dk=8, Dv=16)
    head, states, tail = make_inputs(jax.random.key(1), **shape, dtype=F32, num_slots=4)
    o_ref, st_ref = chunked.gdn_slots(*head, states, *tail)
    o, st = kernel.gdn_ragged(*head, states, *tail, chunk=8, interpret=True)
    err = max(float(jnp.abs(o - o_ref).max()), float(jnp.abs(st - st_ref).max()))
    scale = max(float(jnp.abs(o_ref).max()), float(jnp.abs(st_ref).max()))
    print(f"gdn_ragged (interpret) vs xla: max |diff| {err:.2e} at scale {scale:.2e}")
    S = shape["S"]
    dec = tuple(a[:S] for a in head[:5]) + (jnp.arange(S + 1, dtype=jnp.int32), jnp.int32(S))
    o_ref, st_ref = chunked.gdn_decode_slots(*dec, states, *tail)
    o, st = decode_kernel.gdn_decode(*dec, states, *tail, interpret=True)
    err2 = max(float(jnp.abs(o - o_ref).max()), float(jnp.abs(st - st_ref).max()))
    print(f"gdn_decode (interpret) vs xla: max |diff| {err2:.2e}")
    assert max(err, err2) <= 1e-5 * scale, "interpret-mode kernels disagree with the xla backend"


def bench_gdn(dtype=jnp.bfloat16, chunk: int = 64) -> None:
    platform = jax.default_backend()
    check_interpret()
    rate, bw = matmul_rate(), copy_bandwidth()
    print(f"{platform}: matmul rate {rate / 1e9:.1f} GFLOP/s (f32), copy bandwidth {bw / 1e9:.1f} GB/s")
    # Qwen3-Next-80B per chip at tp 4: 32 value heads / 4, head dims 128.
    heads = dict(H=8, Dk=128, Dv=128)
    prefill = dict(T=2048, S=4, **heads)  # a 2048-token prefill chunk of 4 sequences
    decode = dict(T=64, S=64, **heads)  # 64 sequences, one token each
    compute = chunked_flops(prefill["T"], heads["H"], 128, 128, chunk) / rate
    state = decode_bytes(decode["S"], heads["H"], 128, 128, jnp.dtype(dtype).itemsize) / bw
    T, S = prefill["T"], prefill["S"]
    gflop = chunked_flops(T, 8, 128, 128, chunk) / 1e9
    done = chunked_flops(T, 8, 128, 128, chunk, inverse=True) / 1e9
    print(
        f"prefill T={T} S={S} H=8 Dk=Dv=128 chunk={chunk}: {gflop:.2f} GFLOP (the floor; "
        f"{done:.2f} as computed, the UT system inverted by block doubling)"
    )
    run_case(f"xla gdn_slots (chunked) T={T}", chunked.gdn_slots, prefill, dtype, compute, "compute")
    print(f"decode S={decode['S']}: {decode_bytes(decode['S'], 8, 128, 128, 2) / 1e6:.1f} MB")
    run_case(f"xla gdn_decode_slots S={decode['S']}", chunked.gdn_decode_slots, decode, dtype, state, "byte")
    if platform != "tpu":
        why = "Mosaic TPU kernels" if platform == "gpu" else "interpret mode only on CPU"
        print(f"Pallas timings need a TPU ({why}); platform here: {platform}")
        return
    for prec in (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT):
        tag = prec.name.lower()
        run_case(
            f"gdn_ragged T={T} chunk={chunk} {tag}",
            kernel.gdn_ragged,
            prefill,
            dtype,
            compute,
            "compute",
            chunk=chunk,
            precision=prec,
        )
        run_case(
            f"gdn_decode S={decode['S']} {tag}",
            decode_kernel.gdn_decode,
            decode,
            dtype,
            state,
            "byte",
            precision=prec,
        )


if __name__ == "__main__":
    bench_gdn()
