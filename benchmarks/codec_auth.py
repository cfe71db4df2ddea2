"""What a page-auth key costs: page encode + decode with and without an HMAC-SHA256 MAC,
side by side in one run, and whether the MAC lets the prefetch threads run in parallel.

    python benchmarks/codec_auth.py [--sizes 64K,256K,1536K] [--seconds 1.0] [--threads 2]

Per page size (two bfloat16 arrays, k and v, filling the page):
  plain  encode_page / decode_page as a keyless server runs them (crc32 only, format 1)
  keyed  the same with an auth key (crc32 + HMAC-SHA256 over the page, format 2)
Each is timed by alternating plain and keyed rounds of about `--seconds` each, three times,
best round kept (a shared machine's noise falls on both alike); the keyed/plain ratio is
what the key adds to the codec, not to an L3 read (the store's I/O comes on top of both).

GIL: decode_page with a key runs on `--threads` threads (the client's prefetch pool) against
one thread, same pages (scaling needs free cores: on a shared 2-core box it is capped by the
load); and the main thread's longest stall is measured while another thread MACs 64 MiB in
one `update` call, beside a control call that holds the GIL. If the MAC held the GIL, the
main thread would stall for the whole call, as it does for the control.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from hicache_jax.storage.codec import decode_page, encode_page

KEY = b"benchmark-key-0123456789abcdef"
FP = "0123456789abcdef"
PAGE_KEY = "pages/model/kv_dtype=bfloat16,page_size=16/nosalt/ab/cd/" + "ab" * 32 + ".kv"


def _page(nbytes: int) -> dict[str, np.ndarray]:
    half = nbytes // 2 // 2  # two arrays of bfloat16
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(half, np.float32).astype(ml_dtypes.bfloat16) for n in ("k", "v")}


def _rate(fn, seconds: float) -> float:
    """Calls of `fn` per second over about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        fn()
        n += 1
    return n / dt


def bench_size(nbytes: int, seconds: float) -> dict:
    arrays = _page(nbytes)
    plain = encode_page(arrays, FP, PAGE_KEY)
    keyed = encode_page(arrays, FP, PAGE_KEY, auth_key=KEY)
    cases = {
        "plain": lambda: decode_page(encode_page(arrays, FP, PAGE_KEY), FP, PAGE_KEY),
        "keyed": lambda: decode_page(
            encode_page(arrays, FP, PAGE_KEY, auth_key=KEY), FP, PAGE_KEY, auth_key=KEY
        ),
        "plain_decode": lambda: decode_page(plain, FP, PAGE_KEY),
        "keyed_decode": lambda: decode_page(keyed, FP, PAGE_KEY, auth_key=KEY),
    }
    best = dict.fromkeys(cases, 0.0)
    for _ in range(3):  # alternate: drift on a shared box falls on every case
        for name, fn in cases.items():
            best[name] = max(best[name], _rate(fn, seconds / 2))
    us = {name: 1e6 / r for name, r in best.items()}
    return {
        "bytes": len(plain),
        "encode_decode_us": {"plain": us["plain"], "keyed": us["keyed"]},
        "decode_us": {"plain": us["plain_decode"], "keyed": us["keyed_decode"]},
        "ratio_encode_decode": us["keyed"] / us["plain"],
        "ratio_decode": us["keyed_decode"] / us["plain_decode"],
        "keyed_decode_gbps": len(keyed) / us["keyed_decode"] / 1e3,
    }


def bench_threads(nbytes: int, threads: int, seconds: float) -> dict:
    """Keyed decodes per second on one thread and on `threads` (the prefetch pool)."""
    keyed = encode_page(_page(nbytes), FP, PAGE_KEY, auth_key=KEY)
    decode = lambda: decode_page(keyed, FP, PAGE_KEY, auth_key=KEY)  # noqa: E731
    one = _rate(decode, seconds)
    with ThreadPoolExecutor(threads) as pool:
        rates = list(pool.map(lambda _: _rate(decode, seconds), range(threads)))
    return {
        "threads": threads,
        "one_thread_per_s": one,
        "all_threads_per_s": sum(rates),
        "speedup": sum(rates) / one,
    }


def bench_gil(mib: int = 64) -> dict:
    """The longest the main thread went without running Python while another thread was in
    one long C call: one HMAC update of `mib` MiB, and, as the control, a big-integer power
    (a C call that holds the GIL). A call that holds the GIL stalls the main thread for all
    of it; one that releases it, for a scheduler time slice at most."""
    data = memoryview(bytearray(mib << 20))

    def stall_ms(call) -> tuple[float, float]:
        done = threading.Event()
        took = []

        def work():
            time.sleep(0.02)  # the main thread is looping by then
            t0 = time.perf_counter()
            call()
            took.append(time.perf_counter() - t0)
            done.set()

        threading.Thread(target=work).start()
        gap, last = 0.0, time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
        return gap * 1e3, took[0] * 1e3

    mac = hmac.new(KEY, digestmod=hashlib.sha256)
    mac_stall, mac_ms = stall_ms(lambda: mac.update(data))
    held_stall, held_ms = stall_ms(lambda: pow(3, 1_500_000))
    return {
        "mac_ms": mac_ms,
        "mac_stall_ms": mac_stall,
        "control_ms": held_ms,
        "control_stall_ms": held_stall,
    }


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    return int(float(text.rstrip("KM")) * mult)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,256K,1536K")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    out = {
        "sizes": {s: bench_size(s, args.seconds) for s in sizes},
        "threads": bench_threads(sizes[-1], args.threads, args.seconds),
        "gil": bench_gil(),
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    print(
        f"{'page':>8} {'plain enc+dec':>14} {'keyed enc+dec':>14} {'ratio':>6}"
        f" {'plain dec':>10} {'keyed dec':>10} {'ratio':>6}"
    )
    for s, r in out["sizes"].items():
        ed, d = r["encode_decode_us"], r["decode_us"]
        print(
            f"{s >> 10:>6}Ki {ed['plain']:>12.0f}us {ed['keyed']:>12.0f}us {r['ratio_encode_decode']:>6.2f}"
            f" {d['plain']:>8.0f}us {d['keyed']:>8.0f}us {r['ratio_decode']:>6.2f}"
        )
    t, g = out["threads"], out["gil"]
    print(
        f"keyed decode of {sizes[-1] >> 10} KiB pages: {t['one_thread_per_s']:.0f}/s on 1 thread, "
        f"{t['all_threads_per_s']:.0f}/s on {t['threads']} ({t['speedup']:.2f}x)"
    )
    print(
        f"longest main-thread stall while another thread runs: a {g['mac_ms']:.0f} ms HMAC update "
        f"{g['mac_stall_ms']:.1f} ms; a {g['control_ms']:.0f} ms GIL-holding call (control) "
        f"{g['control_stall_ms']:.1f} ms"
    )
    return out


if __name__ == "__main__":
    main()
