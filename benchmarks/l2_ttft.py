"""An L2 hit's TTFT against its floor: the same prompt's L1-hit TTFT plus the bytes the hit
loads over the host -> device copy bandwidth, all measured in one run.

    python benchmarks/l2_ttft.py [--server_flags "..."] [--prompt_tokens 4096] [--repeats 5]
                                 [--layerwise_pages 0 256]

One server with the host tier on (write-through, ``--hicache_ratio`` large enough to keep
everything the run sends). Each repeat, on fresh random tokens:

1. the prompt, cold (every token computed);
2. the prompt again: an L1 hit (all but the last page from the device);
3. filler prompts of other tokens, more than the device pool in all: the prompt's device
   pages are evicted, least recently used first, and their host copies stay;
4. the prompt again: an L2 hit (its pages loaded host -> device, then the last page
   computed, as in 2).

With several ``--layerwise_pages`` values (``--hicache_layerwise_pages``: 0 loads an L2 hit
before the step, N > 0 takes up to N pages of each page group into the step, layer by
layer), one server per value runs side by side, each repeat sending the same prompts to
each in turn.

The floor of 4 is 2 plus (pages loaded x page bytes) / bandwidth, the bandwidth measured
here on that many bytes, the faster of two copies: ``jax.device_put`` from a numpy array to
this machine's default device (the server's platform, when both run on one machine), and a
plain memcpy between two host buffers. On a TPU or GPU host the first is the host -> device
DMA; on CPU the "device" is host memory, where ``device_put`` (about 1.2 GB/s here, a fresh
buffer each time) is slower than a memcpy (about 6 GB/s), which is then the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import time

import httpx
import numpy as np

from hicache_jax.bench.client import BenchClient, fetch_info
from hicache_jax.bench.server_process import REPO_CONFIGS, ServerProcess

GOAL = 1.3  # L2-hit TTFT over its floor, at most


def copy_bytes_per_s(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Bandwidth of copying ``nbytes`` (the median of ``repeats``): host -> default device by
    ``jax.device_put``, and host -> host by memcpy."""
    import jax

    host = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    other = np.empty_like(host)

    def put():
        jax.device_put(host).block_until_ready()

    def memcpy():
        np.copyto(other, host)

    out = {}
    for name, copy in (("device_put", put), ("memcpy", memcpy)):
        copy()  # first-use costs out of the numbers
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times)
    return out


async def _ttft(url: str, prompt: list[int]) -> tuple[float, dict]:
    client = BenchClient(url, timeout_s=1800)
    try:
        rec = await client.generate(prompt, 1, 0)
    finally:
        await client.aclose()
    if not rec.ok:
        raise RuntimeError(f"request failed: {rec.error}")
    return rec.ttft, rec.cached_tiers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--server_flags",
        default=f"--flagfile={os.path.join(REPO_CONFIGS, 'cpu.flags')} --preset=100m "
        "--max_total_tokens=8192 --chunked_prefill_size=512",
    )
    ap.add_argument("--prompt_tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out_dir", default="l2-ttft-out")
    ap.add_argument("--layerwise_pages", type=int, nargs="+", default=[None])
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    flags = shlex.split(a.server_flags)
    flags += ["--enable_hierarchical_cache", "--hicache_write_policy=write_through", "--hicache_ratio=8"]
    variants = {
        "default" if n is None else f"layerwise {n}": flags
        + ([] if n is None else [f"--hicache_layerwise_pages={n}"])
        for n in a.layerwise_pages
    }
    rng = np.random.default_rng(0)
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(
                ServerProcess(
                    f,
                    log_path=os.path.join(a.out_dir, f"server-{name.replace(' ', '-')}.log"),
                    startup_timeout=1800,
                )
            )
            for name, f in variants.items()
        }
        first = next(iter(servers.values()))
        info = fetch_info(first.url)
        with httpx.Client(base_url=first.url) as c:
            model = c.get("/get_model_info").json()
        P, pool, vocab = info.rules.page_size, info.device_tokens, info.vocab_size
        page_bytes = P * model["kv_bytes_per_token"]
        if a.prompt_tokens > pool // 2:
            raise SystemExit(f"--prompt_tokens={a.prompt_tokens}: at most half the device pool ({pool // 2})")
        filler_tokens = pool // 2
        fillers = -(-2 * pool // filler_tokens) + 1  # more than the pool, past the prompt's pages
        print(f"prompt {a.prompt_tokens} tokens, device pool {pool}, {fillers} fillers of {filler_tokens}")
        print(f"page {P} tokens, {page_bytes / 2**10:.0f} KiB of KV")

        def tokens(n: int) -> list[int]:
            return rng.integers(3, vocab, n).tolist()

        for r in range(a.repeats + 1):  # repeat 0 compiles what the others run
            prompt = tokens(a.prompt_tokens)
            filler = [tokens(filler_tokens) for _ in range(fillers)]
            for name, server in servers.items():
                row = _repeat(server.url, prompt, filler, P, page_bytes)
                tag = "warm-up" if r == 0 else f"repeat {r}"
                print(f"{name:13s} {tag:9s} {_line(row)}", flush=True)
                if r:
                    rows[name].append(row)
    print()
    med_l2 = {}
    for name, got in rows.items():
        med = {k: statistics.median(x[k] for x in got) for k in ("cold", "l1", "l2", "floor")}
        ratio = statistics.median(x["l2"] / x["floor"] for x in got)
        med_l2[name] = med["l2"]
        print(
            f"{name}: median of {len(got)}: cold {med['cold'] * 1e3:.1f} ms, "
            f"L1 hit {med['l1'] * 1e3:.1f} ms, "
            f"L2 hit {med['l2'] * 1e3:.1f} ms, floor {med['floor'] * 1e3:.1f} ms; "
            f"L2 hit / floor {ratio:.2f} (goal <= {GOAL}); L2 hit / cold {med['l2'] / med['cold']:.2f}"
        )
    if len(rows) > 1:
        base = next(iter(med_l2))
        for name, l2 in med_l2.items():
            print(f"L2 hit TTFT, {name} / {base}: {l2 / med_l2[base]:.2f}")


def _repeat(url: str, prompt: list[int], fillers: list[list[int]], P: int, page_bytes: int) -> dict:
    """Cold, L1 hit, fillers, L2 hit on one server; the floor from a copy measured now."""
    httpx.post(url + "/flush_cache", timeout=600).raise_for_status()
    cold, _ = asyncio.run(_ttft(url, prompt))
    l1, l1_tiers = asyncio.run(_ttft(url, prompt))
    for f in fillers:
        asyncio.run(_ttft(url, f))
    l2, l2_tiers = asyncio.run(_ttft(url, prompt))
    loaded = l2_tiers["host"] // P * page_bytes
    bws = copy_bytes_per_s(max(loaded, 1 << 20))
    bw = max(bws.values())
    return dict(
        cold=cold, l1=l1, l2=l2, loaded=loaded, bw=bw, bws=bws, floor=l1 + loaded / bw,
        l1_tiers=l1_tiers, l2_tiers=l2_tiers,
    )  # fmt: skip


def _line(row: dict) -> str:
    return (
        f"cold {row['cold'] * 1e3:7.1f} ms  L1 hit {row['l1'] * 1e3:6.1f} ms  "
        f"L2 hit {row['l2'] * 1e3:6.1f} ms "
        f"({row['l2_tiers']['host']} host + {row['l2_tiers']['device']} device tokens; "
        f"{row['loaded'] / 2**20:.1f} MiB at {row['bw'] / 1e9:.1f} GB/s; device_put "
        f"{row['bws']['device_put'] / 1e9:.1f})  floor {row['floor'] * 1e3:6.1f} ms  "
        f"L2/floor {row['l2'] / row['floor']:.2f}"
    )


if __name__ == "__main__":
    main()
