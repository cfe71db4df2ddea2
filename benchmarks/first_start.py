"""A newcomer's first minutes, timed: the README's quickstart server, its first chat request,
the same request again, a cache hit, and a restart against the compilation cache.

    python benchmarks/first_start.py [--out benchmarks/results/first_start.json]

Three servers, one after the other, each ``python -m hicache_jax.serve
--flagfile=configs/cpu.flags --model_path=smollm2-135m-instruct`` as the README starts it,
with a fresh cache directory (``XDG_CACHE_HOME``) for the run:

- **cold**: the quickstart's flags as they are (warm-up on, the compilation cache empty);
- **restart**: the same, again: warm-up loads every program from the cache the first start
  filled;
- **before**: ``--warmup=false --compilation_cache_dir=none``, the quickstart as it was
  (each shape compiles on first use).

For each: seconds from the process start to ``/health`` answering (ready), then the README's
chat request twice and its ``/generate`` request twice (the second finds the prompt's pages
cached), each request's wall time and cached tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hicache_jax.bench.server_process import ServerProcess  # noqa: E402

QUICKSTART = ["--flagfile=configs/cpu.flags", "--model_path=smollm2-135m-instruct"]
CHAT = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 32,
    "temperature": 0,
}
GENERATE = {
    "text": "Paris is the capital and largest city of France. It is known for its museums, its cafes "
    "and the Eiffel Tower, which was built for the world fair of",
    "sampling_params": {"max_new_tokens": 16, "temperature": 0},
}


def timed(client: httpx.Client, path: str, body: dict) -> dict:
    t0 = time.perf_counter()
    r = client.post(path, json=body)
    r.raise_for_status()
    out = r.json()
    if "choices" in out:
        text = out["choices"][0]["message"]["content"]
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    else:
        text, cached = out["text"], out["meta_info"]["cached_tokens"]
    return {"seconds": round(time.perf_counter() - t0, 2), "cached_tokens": cached, "text": text}


def one_server(name: str, extra: list[str], env: dict, logs: str) -> dict:
    t0 = time.perf_counter()
    with ServerProcess(
        QUICKSTART + extra,
        log_path=os.path.join(logs, f"{name}.log"),
        startup_timeout=1800,
        env=env,
        cwd=ROOT,
    ) as server:
        ready = time.perf_counter() - t0
        with httpx.Client(base_url=server.url, timeout=600) as client:
            requests = {
                "chat": timed(client, "/v1/chat/completions", CHAT),
                "chat again": timed(client, "/v1/chat/completions", CHAT),
                "generate": timed(client, "/generate", GENERATE),
                "generate again": timed(client, "/generate", GENERATE),
            }
        waited = [line.strip() for line in open(server.log_path) if "waited" in line and "compile" in line]
    result = {
        "ready_seconds": round(ready, 1),
        "requests": requests,
        "steps_that_waited_on_a_compile": len(waited),
    }
    print(name, json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-start-") as tmp:
        env = dict(os.environ, XDG_CACHE_HOME=os.path.join(tmp, "cache"))
        for var in ("JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS"):
            env.pop(var, None)  # as a user's shell has them
        results = {
            "cold": one_server("cold", [], env, tmp),
            "restart": one_server("restart", [], env, tmp),
            "before": one_server("before", ["--warmup=false", "--compilation_cache_dir=none"], env, tmp),
        }
    cold, restart = results["cold"], results["restart"]
    summary = {
        "first chat after ready, s": cold["requests"]["chat"]["seconds"],
        "same chat again, s": cold["requests"]["chat again"]["seconds"],
        "restart ready / first ready": round(restart["ready_seconds"] / cold["ready_seconds"], 2),
        "before: first chat, s": results["before"]["requests"]["chat"]["seconds"],
        "before: ready, s": results["before"]["ready_seconds"],
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "servers": results}, f, indent=1)


if __name__ == "__main__":
    main()
