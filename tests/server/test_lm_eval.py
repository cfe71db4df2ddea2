"""lm-eval's ``local-completions`` model scores a multiple-choice task through
``/v1/completions`` (``echo`` + ``logprobs``, token-id prompts), against a server on a tiny
random-weight Llama checkpoint; every per-choice loglikelihood lm-eval records matches
transformers' on the same checkpoint (sum of log-softmax of the choice's tokens given the
context) to 1e-4. Offline: the task is a local JSONL file, the tokenizer the checkpoint's."""

from __future__ import annotations

import json
import shutil

import pytest

from hicache_jax.models.presets import TOKENIZER
from tests import hf_checkpoints
from tests.server.conftest import Server

lm_eval = pytest.importorskip("lm_eval")

NAME = "tiny-llama"
TASK = "hicache_tiny_mc"
DOCS = [
    ("The sky is", ["blue", "green", "loud", "made of cheese"], 0),
    ("Two plus two is", ["four", "five", "a fish"], 0),
    ("Cats like to", ["sleep", "fly", "sing opera", "drive"], 0),
    ("Water boils at one hundred", ["degrees", "apples", "miles"], 0),
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("A week has seven", ["days", "cars", "moons"], 0),
    ("Snow is usually", ["white", "purple", "hot"], 0),
    ("Fish live in", ["water", "trees", "the desert"], 0),
    ("The sun rises in the", ["east", "west", "basement"], 0),
    ("Bread is made from", ["flour", "glass", "stones", "rain"], 0),
]
TASK_YAML = """\
task: TASK
dataset_path: json
dataset_kwargs:
  data_files:
    test: DOCS
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{question}}\\nA:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A 2-layer Llama with the tiny preset's 500-token byte-level BPE beside it."""
    out = hf_checkpoints.make("llama", str(tmp_path_factory.mktemp("llama_tok")))
    shutil.copy(TOKENIZER, f"{out}/tokenizer.json")
    with open(f"{out}/tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, f)
    return out


@pytest.fixture(scope="module")
def llama_server(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm_eval_server")
    s = Server(
        "cpu.flags",
        f"--model_path={checkpoint}",
        f"--served_model_name={NAME}",
        "--chunked_prefill_size=64",
        "--max_running_requests=4",
        "--max_total_tokens=2048",
        "--context_length=512",
        log_path=str(tmp / "server.log"),
    )
    yield s
    s.close()


def _reference(tok, model, context: str, continuation: str) -> float:
    """transformers' loglikelihood of ``continuation`` after ``context``, tokenized as
    lm-eval does for causal models (trailing spaces of the context move to the continuation;
    the whole string is encoded, then split at the context's length)."""
    import torch

    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def test_lm_eval_multiple_choice_matches_transformers(checkpoint, llama_server, tmp_path, monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS)
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.replace("TASK", TASK).replace("DOCS", str(docs)))

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions",
        model_args={
            "model": NAME,
            "base_url": f"{llama_server.url}/v1/completions",
            "tokenizer": checkpoint,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(checkpoint)
    model = hf_checkpoints.load_reference(checkpoint)
    samples = results["samples"][TASK]
    assert len(samples) == len(DOCS)
    scored = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            got = resp[0][0]
            want = _reference(tok, model, context, continuation)
            assert got == pytest.approx(want, abs=1e-4), (context, continuation)
            scored += 1
    assert scored == sum(len(c) for _, c, _ in DOCS)
    assert 0.0 <= results["results"][TASK]["acc,none"] <= 1.0
