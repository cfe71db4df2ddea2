"""Prefill/decode disaggregation through the shared L3 (issue 45), side by side with two
unified servers, both behind the real sglang-router.

    python benchmarks/pd.py [--model_path smollm2-135m-instruct] [--long 6] [--long_pages 64]
                            [--long_new 4] [--chat 24] [--chat_tokens 48] [--chat_new 32]
                            [--rate 3] [--parts measure,tpu] [--server_flags "..."]

The workload, the same for both fleets: ``--long`` requests with prompts of ``--long_pages``
pages (and half a page more) that ask for ``--long_new`` tokens, and ``--chat`` short chat
turns of ``--chat_tokens`` tokens that ask for ``--chat_new``, shuffled and sent at a fixed
``--rate`` per second, every one streamed (``/generate`` with token ids, greedy, no EOS), on
random tokens that no two requests share. The fleets, one after the other, each on a fresh L3
directory and the same server flags (``--server_flags`` after ``configs/hicache_l3_cpu.flags``):

- PD: one ``--disaggregation_mode=prefill`` and one ``--disaggregation_mode=decode`` server
  behind ``launch_router --pd-disaggregation`` (round_robin);
- unified: two ordinary servers behind ``launch_router --worker-urls`` (cache_aware).

Before each measured phase a warm-up pass of the same shapes on other tokens compiles what
the phase runs. Reported per fleet: TTFT and ITL p50/p99 at the client (ITL: the gaps between
streamed tokens), for all requests and per class. For PD, per request the decode server
reports its handover (``meta_info.disaggregation``: status, the wait for the marker) and its
TTFT from the request's arrival at its engine, which is right after the marker was read:
the handover time (marker seen -> first token); ``admitted`` is the part of it until the
engine admitted the request (its L3 read landed). Its floor is the bytes the prompt's pages
take in L3 (storage-hit pages x the store's bytes per page: every file of a page, so for a
sliding-window model, whose hit reads only the window's sliding pages, an upper bound) over
the read bandwidth of those page files measured in the same run: a plain read of every page
file the run wrote, by 8 threads, after ``posix_fadvise(DONTNEED)`` (cold-ish) and again
(warm: the decode server reads pages the prefill server wrote moments before, from the page
cache). The floor uses the faster.

On a 2-core machine both servers of a fleet share the cores: a prefill step on the prefill
server still takes the CPU from the decode server's steps, so PD cannot show the isolation it
buys on separate chips. What it can show is the handover's cost. The ``tpu`` part prints what
the planner (``hicache_jax/tpu/planner.py``: compiled for TPU by libtpu, no chip, rooflines)
predicts for a prefill slice and a decode slice of ``--tpu_model`` on ``--tpu_topology``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from hicache_jax.bench.client import _sse_events
from hicache_jax.bench.server_process import REPO_CONFIGS, ServerError, ServerProcess, free_port
from hicache_jax.kinds import L3_SUFFIX, RETENTION, Retention

READ_THREADS = 8


# ---------------------------------------------------------------- fleets


class Router:
    """``python -m sglang_router.launch_router ARGS`` on free ports, its log in a file."""

    def __init__(self, args: list[str], log_path: str, timeout_s: float = 120):
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(log_path, "w")
        self.log_path = log_path
        port = self.url.rsplit(":", 1)[1]
        # Its Prometheus exporter listens too: on its default port a second router fails to start.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *args, "--host", "127.0.0.1"]
        cmd += ["--port", port, "--prometheus-port", str(free_port()), "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        self.close()
        raise ServerError(f"router not healthy after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def fleet(kind: str, flags: list[str], work: Path, env: dict):
    """Two servers on one fresh L3 directory and a router in front: ``kind`` "pd" (prefill +
    decode, PD mode) or "unified" (two ordinary servers, cache_aware). Yields (router URL,
    servers, L3 directory); stops every process after."""
    l3 = work / f"l3-{kind}"
    roles = ("prefill", "decode") if kind == "pd" else ("null", "null")
    servers: list[ServerProcess] = []
    router = None
    try:

        def start(i: int, role: str) -> ServerProcess:
            extra = [f"--hicache_storage_spec={l3}", f"--disaggregation_mode={role}"]
            log = str(work / f"{kind}-{i}-{role}.log")
            # The first start compiles every step shape (--warmup) into the compilation cache.
            root = os.path.dirname(REPO_CONFIGS)
            return ServerProcess([*flags, *extra], log_path=log, env=env, cwd=root, startup_timeout=1800)

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start, i, role) for i, role in enumerate(roles)]
            servers += [f.result() for f in futures if f.exception() is None]
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
        if kind == "pd":
            args = ["--pd-disaggregation", "--prefill", servers[0].url, "none", "--decode", servers[1].url]
            args += ["--policy", "round_robin"]
        else:
            args = ["--worker-urls", *(s.url for s in servers), "--policy", "cache_aware"]
        router = Router(args, str(work / f"{kind}-router.log"))
        yield router.url, servers, l3
    finally:
        if router is not None:
            router.close()
        for s in servers:
            s.close()


# ---------------------------------------------------------------- the workload


def mixture(args, vocab: int, page: int, seed: int) -> list[dict]:
    """The requests in the order they are sent: ``{cls, ids, new, at}``, ``at`` in seconds
    from the phase's start. Tokens are random in [3, vocab): no two prompts share a page."""
    rng = np.random.default_rng(seed)
    long_len = args.long_pages * page + page // 2
    reqs = [{"cls": "long", "len": long_len, "new": args.long_new} for _ in range(args.long)]
    reqs += [{"cls": "chat", "len": args.chat_tokens, "new": args.chat_new} for _ in range(args.chat)]
    random.Random(seed).shuffle(reqs)
    for i, r in enumerate(reqs):
        r["ids"] = rng.integers(3, vocab, r.pop("len")).tolist()
        r["at"] = i / args.rate
    return reqs


async def stream_one(http: httpx.AsyncClient, t0: float, r: dict) -> dict:
    """One streamed ``/generate``: its send time, first-token time and inter-token gaps
    (seconds; an event carrying k new tokens counts k gaps of 1/k of its own), and the
    last event's ``meta_info``."""
    await asyncio.sleep(max(0.0, r["at"] - (time.perf_counter() - t0)))
    sampling = {"max_new_tokens": r["new"], "temperature": 0, "ignore_eos": True}
    body = {"input_ids": r["ids"], "sampling_params": sampling, "stream": True}
    out = {"cls": r["cls"], "prompt": len(r["ids"]), "gaps": [], "meta": {}, "error": None}
    sent = last = time.perf_counter()
    n = 0
    try:
        async with http.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return out
            async for event in _sse_events(resp):
                if "error" in event:
                    out["error"] = str(event["error"])[:300]
                    return out
                now, k = time.perf_counter(), len(event.get("output_ids") or ()) - n
                if k > 0:
                    if n == 0:
                        out["ttft"] = now - sent
                    else:
                        out["gaps"] += [(now - last) / k] * k
                    n, last = n + k, now
                out["meta"] = event.get("meta_info") or out["meta"]
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    if "ttft" not in out and out["error"] is None:
        out["error"] = "no output token"
    out["tokens"] = n
    return out


async def run_phase(url: str, reqs: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        t0 = time.perf_counter()
        return await asyncio.gather(*(stream_one(http, t0, r) for r in reqs))


# ---------------------------------------------------------------- L3 bytes and bandwidth


EVERY_PAGE = {suffix for kind, suffix in L3_SUFFIX.items() if RETENTION[kind] is Retention.EVERY}


def page_files(l3: Path) -> tuple[list[Path], int]:
    """The store's files of the kinds a hit reads every page of (full attention, latent:
    ``<hash>.<suffix>``), and how many pages they hold. Sliding-window pages (a hit reads its
    window's) and state snapshots (one) are left out: the floor counts what every hit reads."""
    files = sorted(p for p in (l3 / "pages").rglob("*") if p.is_file() and p.suffix[1:] in EVERY_PAGE)
    return files, len({p.with_suffix("") for p in files})


def read_bandwidth(files: list[Path], repeats: int = 3) -> dict[str, float]:
    """Bytes per second of reading every file whole, by ``READ_THREADS`` threads: cold-ish
    (after sync and ``posix_fadvise(DONTNEED)``) and warm (straight after, best of
    ``repeats``)."""

    def read(p: Path) -> int:
        with open(p, "rb", buffering=0) as f:
            return len(f.read())

    def timed() -> tuple[int, float]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(READ_THREADS) as pool:
            nbytes = sum(pool.map(read, files))
        return nbytes, time.perf_counter() - t0

    os.sync()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    nbytes, cold = timed()
    warm = min(timed()[1] for _ in range(repeats))
    suffixes = sorted({p.suffix[1:] for p in files})
    return {"bytes": nbytes, "cold": nbytes / cold, "warm": nbytes / warm, "suffixes": suffixes}


# ---------------------------------------------------------------- report


def q(values: list[float], p: int) -> float | None:
    return 1000 * float(np.percentile(values, p)) if values else None


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def latency_rows(name: str, outs: list[dict]) -> list[str]:
    rows = []
    for cls in ("all", "long", "chat"):
        sel = [o for o in outs if o["error"] is None and cls in ("all", o["cls"])]
        ttft = [o["ttft"] for o in sel]
        gaps = [g for o in sel for g in o["gaps"]]
        cells = [q(ttft, 50), q(ttft, 99), q(gaps, 50), q(gaps, 99)]
        rows.append(f"| {name} | {cls} | {len(sel)} | " + " | ".join(ms(c) for c in cells) + " |")
    return rows


def handover_report(outs: list[dict], page: int, page_bytes: float, bw: dict) -> list[str]:
    """Per request class on the decode server: status counts, the wait for the marker, the
    handover time against its floor."""
    best = max(bw["cold"], bw["warm"])
    lines = [
        f"L3 files a hit reads whole (.{', .'.join(bw['suffixes'])}): {page_bytes / 1024:,.1f} KiB a page; "
        f"read {bw['bytes'] / 2**20:,.1f} MiB at "
        f"{bw['cold'] / 1e9:.2f} GB/s cold-ish, {bw['warm'] / 1e9:.2f} GB/s warm ({READ_THREADS} threads, "
        "best of 3); the floor is the storage-hit pages' bytes at the faster",
        "",
        "| class | handovers | fallbacks | storage-hit tokens | L3 MiB | wait for marker p50 ms "
        "| handover p50 ms | handover p99 ms | admitted p50 ms | server l3_read p50 ms | floor ms "
        "| handover p50 / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cls in ("long", "chat"):
        sel = [o for o in outs if o["error"] is None and o["cls"] == cls]
        pd = [o["meta"].get("disaggregation") or {} for o in sel]
        done = [o for o, d in zip(sel, pd) if d.get("status") == "handover"]
        falls = sum(d.get("status") == "fallback" for d in pd)
        if not done:
            lines.append(f"| {cls} | 0 | {falls} |" + " - |" * 9)
            continue
        hit = int(np.median([(o["meta"].get("cached_tokens_details") or {}).get("storage", 0) for o in done]))
        nbytes = hit // page * page_bytes
        floor = nbytes / best
        handover = [o["meta"]["ttft"] for o in done]
        wait = [(o["meta"]["disaggregation"]).get("wait_s", 0.0) for o in done]
        timing = [o["meta"].get("timing") or {} for o in done]
        admitted = [t.get("admitted_s", 0.0) for t in timing]
        l3_read = [t.get("l3_read_s", 0.0) for t in timing]
        cells = [q(wait, 50), q(handover, 50), q(handover, 99), q(admitted, 50), q(l3_read, 50), 1000 * floor]
        ratio = np.median(handover) / floor if floor else float("inf")
        lines.append(
            f"| {cls} | {len(done)} | {falls} | {hit:,} | {nbytes / 2**20:,.2f} | "
            + " | ".join(ms(c) for c in cells)
            + f" | {ratio:,.0f} |"
        )
    return lines


# ---------------------------------------------------------------- TPU: the planner


def tpu_part(args, long_tokens: int) -> None:
    """What the planner predicts for ``--tpu_model`` on ``--tpu_topology`` (or, with
    ``--tpu_plan_json``, what a ``python -m hicache_jax.plan --json`` run wrote)."""
    if args.tpu_plan_json:
        with open(args.tpu_plan_json) as f:
            plan = json.load(f)
        where = f"{plan['topology']}, tp {plan['tp_size']}; {args.tpu_plan_json}"
    else:
        import jax.numpy as jnp

        from hicache_jax.config import EngineConfig
        from hicache_jax.tpu import planner
        from hicache_jax.tpu.configs import real_config
        from hicache_jax.tpu.target import target

        model = real_config(args.tpu_model)
        cfg = EngineConfig(
            dtype="bfloat16",
            tp_size=args.tpu_tp,
            page_size=16,
            chunked_prefill_size=args.tpu_chunk,
            max_running_requests=64,
            max_total_tokens=65536,
        )
        tgt = target(args.tpu_topology)
        quiet = (lambda line: print(f"#   {line}", flush=True)) if args.verbose else (lambda line: None)
        memo = os.path.expanduser(args.tpu_memo) if args.tpu_memo else None
        p = planner.plan(model, cfg, tgt, dtype=jnp.bfloat16, depths="auto", progress=quiet, memo=memo)
        print("```")
        print(planner.format_plan(p, model, cfg, tgt))
        print("```")
        plan, where = p.to_json(), f"{args.tpu_topology}, tp {args.tpu_tp}"
    print("\n".join(slice_lines(plan, long_tokens, where)))


def slice_lines(plan: dict, long_tokens: int, where: str) -> list[str]:
    """A plan's figures (``Plan.to_json``) read for PD: a prefill slice runs only prefill
    chunks, a decode slice only decode steps (both slices as the plan's configuration)."""
    steps = list(plan["steps"].values())
    prefill = next(s for s in steps if s["name"].startswith("prefill"))
    chunk_ms = 1e3 * prefill["roofline_s"]
    long_ms = 1e3 * long_tokens / prefill["tokens_per_s"]
    per_token = plan["l3_read_bytes_per_token"]
    nbytes = long_tokens * per_token
    decode = ", ".join(
        f"x{s['tokens']}: {1e3 * s['roofline_s']:.2f} ms" for s in steps if s["name"].startswith("decode")
    )
    return [
        f"Prefill slice ({where}): a {long_tokens:,}-token prompt at {prefill['tokens_per_s']:,.0f} "
        f"tokens/s is {long_ms:,.1f} ms of prefill chunks ({chunk_ms:.2f} ms each); its pages are "
        f"{nbytes / 2**20:,.1f} MiB in L3 ({per_token / 1024:,.0f} KiB a token, at most: window kinds less).",
        f"Handover: reading them takes as long as computing them at {nbytes / long_ms / 1e6:.2f} GB/s "
        "of L3 read bandwidth. The planner knows no store's bandwidth: the handover's time on a TPU host "
        "is not predicted.",
        f"Decode slice: a decode step (the ITL floor) at batch {decode}.",
        f"Unified: a step that carries a prefill chunk computes at least that chunk, so the decodes in it "
        f"wait at least {chunk_ms:.2f} ms (the planner compiles no mixed step: this bound is ours); on a "
        "decode slice no step carries a chunk.",
    ]


# ---------------------------------------------------------------- main


def measure(args) -> int:
    """Both fleets on the same mixture; returns the long prompts' length in tokens."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if args.compilation_cache_dir:
        env |= {
            "JAX_COMPILATION_CACHE_DIR": os.path.expanduser(args.compilation_cache_dir),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
    model = [f"--model_path={args.model_path}"] if args.model_path else []
    flags = [f"--flagfile={REPO_CONFIGS}/hicache_l3_cpu.flags", *model, *shlex.split(args.server_flags)]
    print(f"# {os.cpu_count()} CPUs, shared by both servers of a fleet: PD cannot show its isolation here")
    print(f"# server flags: {' '.join(flags)}", flush=True)
    results, long_tokens = {}, 0
    with contextlib.ExitStack() as stack:
        tmp = args.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="pd-bench-"))
        os.makedirs(tmp, exist_ok=True)
        for kind in args.fleets.split(","):
            t0 = time.perf_counter()
            with fleet(kind, flags, Path(tmp), env) as (url, servers, l3):
                info = httpx.get(servers[0].url + "/model_info", timeout=30).json()
                page, vocab = info["page_size"], info["vocab_size"]
                warm = mixture(args, vocab, page, seed=args.seed + 1)
                reqs = mixture(args, vocab, page, seed=args.seed)
                long_tokens = max(len(r["ids"]) for r in reqs)
                print(f"# {kind}: fleet up in {time.perf_counter() - t0:.0f} s; warm-up pass", flush=True)
                bad = [o["error"] for o in asyncio.run(run_phase(url, warm)) if o["error"]]
                if bad:
                    raise RuntimeError(f"{kind} warm-up: {len(bad)} requests failed, first: {bad[0]}")
                t1 = time.perf_counter()
                outs = asyncio.run(run_phase(url, reqs))
                wall = time.perf_counter() - t1
                errors = [o["error"] for o in outs if o["error"]]
                print(f"# {kind}: {len(outs)} requests in {wall:.1f} s, {len(errors)} errors", flush=True)
                for e in errors[:3]:
                    print(f"#   {e}")
                results[kind] = outs
                if kind == "pd":
                    files, pages = page_files(l3)
                    bw = read_bandwidth(files)
                    pd_text = handover_report(outs, page, bw["bytes"] / pages, bw)
                    metrics = httpx.get(servers[1].url + "/metrics", timeout=30).text
                    counters = [line for line in metrics.splitlines() if line.startswith("hicache_pd_")]
    print(f"\n## TTFT and ITL at the client, ms ({args.long} long + {args.chat} chat at {args.rate:g}/s)\n")
    print("| fleet | class | requests | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|---|")
    for kind, outs in results.items():
        print("\n".join(latency_rows(kind, outs)))
    if "pd" in results:
        print("\n## PD: the decode server's handover (marker seen -> first token) against its floor\n")
        print("\n".join(pd_text))
        print("\ndecode server /metrics: " + ", ".join(c.replace("hicache_", "") for c in counters))
    return long_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="measure,tpu", help="measure (the two fleets), tpu (the planner)")
    p.add_argument("--fleets", default="pd,unified")
    p.add_argument(
        "--model_path", default=None, help="a model (e.g. smollm2-135m-instruct); default the tiny preset"
    )
    p.add_argument(
        "--server_flags",
        default="",
        help="after configs/hicache_l3_cpu.flags (which compile every step shape at start: --warmup)",
    )
    p.add_argument("--long", type=int, default=6, help="long-prompt requests")
    p.add_argument("--long_pages", type=int, default=64, help="pages per long prompt (and half a page)")
    p.add_argument("--long_new", type=int, default=4, help="tokens a long-prompt request asks for")
    p.add_argument("--chat", type=int, default=24, help="chat turns")
    p.add_argument("--chat_tokens", type=int, default=48, help="prompt tokens per chat turn")
    p.add_argument("--chat_new", type=int, default=32, help="tokens a chat turn asks for")
    p.add_argument("--rate", type=float, default=3.0, help="requests sent per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--work_dir", default=None, help="keep the L3 directories and logs here (default: removed)"
    )
    p.add_argument("--compilation_cache_dir", default="~/.cache/hicache-jax-xla", help="'' for none")
    p.add_argument("--tpu_model", default="llama-3-8b", help="a name in hicache_jax/tpu/configs.py")
    p.add_argument("--tpu_topology", default="v5e:2x2")
    p.add_argument("--tpu_tp", type=int, default=4)
    p.add_argument("--tpu_chunk", type=int, default=512, help="the prefill slice's chunked_prefill_size")
    p.add_argument(
        "--tpu_memo", default="~/.cache/hicache-jax-plan/pd.json", help="planner memo ('' for none)"
    )
    p.add_argument(
        "--tpu_plan_json",
        default=None,
        help="read the plan from this file (python -m hicache_jax.plan --json) instead of planning",
    )
    p.add_argument("--verbose", action="store_true", help="print the planner's progress")
    args = p.parse_args()
    parts = args.parts.split(",")
    long_tokens = args.long_pages * 16 + 8
    if "measure" in parts:
        long_tokens = measure(args)
    if "tpu" in parts:
        name = args.tpu_plan_json or f"{args.tpu_model} on {args.tpu_topology}"
        print(f"\n## The planner: {name} (no chip; rooflines)\n")
        if args.tpu_memo and not args.tpu_plan_json:
            os.makedirs(os.path.dirname(os.path.expanduser(args.tpu_memo)), exist_ok=True)
        tpu_part(args, long_tokens)


if __name__ == "__main__":
    main()
