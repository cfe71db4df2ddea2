"""``/v1/completions`` with ``echo``: the prompt's tokens and logprobs in OpenAI's legacy
format, then the generated ones, for every prompt shape; checked against ``/generate``'s
``input_token_logprobs`` (``logprob_start_len`` 0) and its output on the same prompt."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from hicache_jax.models.presets import TOKENIZER as TOKENIZER_FILE

TOKENIZER = Tokenizer.from_file(TOKENIZER_FILE)
MODEL = "tiny"
IDS = [[5, 77, 130, 9, 41, 300, 12], [8, 200, 3]]


def _complete(server, **body) -> dict:
    r = server.client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _reference(server, prompt: dict, max_tokens: int, top: int) -> dict:
    """/generate's prompt logprobs (from token 0) and its greedy output, for one prompt."""
    return server.generate(
        **prompt,
        sampling_params={"max_new_tokens": max_tokens, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=top,
    )


@pytest.mark.parametrize("max_tokens", [0, 2])
@pytest.mark.parametrize(
    "prompt, engine_prompts",
    [
        ("Once upon a time", [{"text": "Once upon a time"}]),
        (["Once upon", "a time there"], [{"text": "Once upon"}, {"text": "a time there"}]),
        (IDS[0], [{"input_ids": IDS[0]}]),
        (IDS, [{"input_ids": ids} for ids in IDS]),
    ],
    ids=["str", "strs", "ids", "lists"],
)
def test_echo_logprobs(server, prompt, engine_prompts, max_tokens):
    out = _complete(server, prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens)
    assert len(out["choices"]) == len(engine_prompts)
    for c, p in zip(sorted(out["choices"], key=lambda c: c["index"]), engine_prompts):
        ref = _reference(server, p, max_tokens, 2)
        meta = ref["meta_info"]
        n = meta["prompt_tokens"]
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + max_tokens
        assert len(lp["text_offset"]) == n + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [t[0] for t in meta["input_token_logprobs"]] + [t[0] for t in meta["output_token_logprobs"]]
        assert lp["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-5)
        for top, got in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
            assert 1 <= len(top) <= 2 and max(top.values()) >= got - 1e-6
        head = p["text"] if "text" in p else TOKENIZER.decode(p["input_ids"], skip_special_tokens=False)
        assert c["text"] == head + ref["text"]
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        if max_tokens:
            assert lp["text_offset"][n] == len(head)


def test_echo_without_logprobs(server):
    out = _complete(server, prompt="Hello there", echo=True, max_tokens=3)
    ref = server.generate(text="Hello there", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert out["choices"][0]["text"] == "Hello there" + ref["text"]
    assert out["choices"][0]["logprobs"] is None


def test_lm_eval_request_shape(server):
    """What lm-eval's local-completions sends for a loglikelihood request."""
    out = _complete(server, prompt=[IDS[0]], echo=True, max_tokens=1, logprobs=1, seed=1234)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(IDS[0]) + 1
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])


def test_echo_stream_refused(server):
    r = server.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "echo": True, "stream": True}
    )
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]
