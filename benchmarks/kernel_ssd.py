"""Mamba2 SSD Pallas kernels against their byte floor.

The floor is the bytes a step must move (x, dt, B, C in, y out, and each sequence's state read
and written once) divided by the copy bandwidth measured in the same run, so the printed ratio
says how far the kernel is from memory-bound. On CPU the kernels only run in interpret mode:
this checks correctness at a small size and says that timings need an accelerator.

    python benchmarks/kernel_ssd.py
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from bandwidth import copy_bandwidth  # noqa: E402  (benchmarks/ is the script dir)

from hicache_jax.models.kernels.mamba2_ssd import chunked, decode_kernel, kernel

F32 = jnp.float32


def _timeit(step, carry, reps: int = 20) -> float:
    """Median seconds of ``carry = step(carry)`` (the state pool is threaded through, donated)."""
    carry = jax.block_until_ready(step(carry))  # compile + warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_inputs(key, *, T, S, H, P, G, N, dtype, num_slots):
    """S equal sequences over T rows, every one continuing from a carried-in state."""
    k = jax.random.split(key, 6)
    x = jax.random.normal(k[0], (T, H, P), dtype)  # [T, H, P]
    dt = jax.nn.softplus(jax.random.normal(k[1], (T, H), F32) - 1.0)  # [T, H]
    A = -jnp.exp(jax.random.uniform(k[2], (H,), F32, -3.0, 0.0))  # [H]
    B = jax.random.normal(k[3], (T, G, N), dtype)  # [T, G, N]
    C = jax.random.normal(k[4], (T, G, N), dtype)  # [T, G, N]
    D = jnp.ones((H,), F32)  # [H]
    cu = jnp.arange(S + 1, dtype=jnp.int32) * (T // S)  # [S + 1]
    states = jax.random.normal(k[5], (num_slots, H, P, N), F32)  # [num_slots, H, P, N]
    slots = jnp.arange(S, dtype=jnp.int32)  # [S]
    return (x, dt, A, B, C, D, cu, jnp.int32(S)), states, (slots, jnp.ones((S,), bool))


def floor_bytes(T, S, H, P, G, N, itemsize) -> int:
    """Bytes that must move: inputs once, y (f32) once, each state read and written once."""
    rows = T * (H * P * itemsize + H * 4 + 2 * G * N * itemsize + H * P * 4)
    return rows + 2 * S * H * P * N * 4


def bench_case(name, fn, shape, bw, dtype, **static) -> None:
    T, S, H, P, G, N = (shape[k] for k in "TSHPGN")
    head, states, tail = make_inputs(
        jax.random.key(0), T=T, S=S, H=H, P=P, G=G, N=N, dtype=dtype, num_slots=S
    )
    call = jax.jit(functools.partial(fn, **static), donate_argnums=8)
    step = lambda st: call(*head, st, *tail)[1]
    secs = _timeit(step, states)
    floor = floor_bytes(T, S, H, P, G, N, jnp.dtype(dtype).itemsize) / bw
    print(f"{name:<44} {secs * 1e3:8.3f} ms   floor {floor * 1e3:7.3f} ms   {secs / floor:5.2f}x floor")


def check_interpret() -> None:
    """Small correctness check of both kernels in interpret mode (no accelerator needed)."""
    shape = dict(T=48, S=3, H=4, P=8, G=2, N=16)
    head, states, tail = make_inputs(jax.random.key(1), **shape, dtype=F32, num_slots=4)
    y_ref, st_ref = chunked.ssd_slots(*head, states, *tail)
    y, st = kernel.ssd_ragged(*head, states, *tail, chunk=8, interpret=True)
    err = max(float(jnp.abs(y - y_ref).max()), float(jnp.abs(st - st_ref).max()))
    scale = max(float(jnp.abs(y_ref).max()), float(jnp.abs(st_ref).max()))
    print(f"ssd_ragged (interpret) vs xla: max |diff| {err:.2e} at scale {scale:.2e}")
    S = shape["S"]
    dec = (head[0][:S], head[1][:S], head[2], head[3][:S], head[4][:S], head[5])
    dec = dec + (jnp.arange(S + 1, dtype=jnp.int32), jnp.int32(S))
    y_ref, st_ref = chunked.ssd_decode_slots(*dec, states, *tail)
    y, st = decode_kernel.ssd_decode(*dec, states, *tail, interpret=True)
    err = max(float(jnp.abs(y - y_ref).max()), float(jnp.abs(st - st_ref).max()))
    print(f"ssd_decode (interpret) vs xla: max |diff| {err:.2e}")
    assert err <= 1e-5 * scale, "interpret-mode kernels disagree with the xla backend"


def bench_ssd(dtype=jnp.bfloat16, chunk: int = 128) -> None:
    """Time the Pallas SSD kernels against their byte floor (TPU), or check them (elsewhere)."""
    platform = jax.default_backend()
    check_interpret()
    if platform != "tpu":
        why = "Mosaic TPU kernels" if platform == "gpu" else "interpret mode only on CPU"
        print(f"timings need a TPU ({why}); platform here: {platform}")
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    # Mamba2-2.7B-like heads (Bamba-9B / Nemotron-H use the same P=64, N=128).
    prefill = dict(T=8192, S=8, H=128, P=64, G=1, N=128)
    decode = dict(T=256, S=256, H=128, P=64, G=1, N=128)
    for prec in (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT):
        tag = prec.name.lower()
        bench_case(
            f"ssd_ragged T=8192 S=8 chunk={chunk} {tag}",
            kernel.ssd_ragged,
            prefill,
            bw,
            dtype,
            chunk=chunk,
            precision=prec,
        )
        bench_case(f"ssd_decode S=256 {tag}", decode_kernel.ssd_decode, decode, bw, dtype, precision=prec)
    bench_case("xla ssd_slots (reference point)", chunked.ssd_slots, prefill, bw, dtype)


if __name__ == "__main__":
    bench_ssd()
