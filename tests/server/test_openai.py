"""The OpenAI API through the official ``openai`` client: completions, chat, streaming."""

from __future__ import annotations

import numpy as np
import openai
import pytest

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_reports_cached_tokens(client):
    prompt = np.random.default_rng(3).integers(3, 500, size=6 * 16).tolist()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 4 and first.usage.prompt_tokens == len(prompt)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 16
    assert second.choices[0].text == first.choices[0].text


def test_completion_stream_equals_whole(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_chat(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 5
    assert len(choice.logprobs.content) == 5
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_equals_whole(client):
    kw = dict(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=0
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt just ran


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="a", max_tokens=2)
