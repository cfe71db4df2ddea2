"""``n > 1`` on ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``, on a server
with a small pool (32 pages) so that concurrent choices evict and retract.

The reference is a recompute: choice ``j`` of a request seeded with S must be, token for
token, what a single (``n = 1``) request seeded with ``(S + j) mod 2**32`` returns. The
prompt is computed once: choices 1..n-1 find it cached, up to its last full page before
the final token."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import PAGE_SIZE, TEST_FLAGS, Server
from tests.waits import wait

MODEL = "tiny"
POOL_TOKENS = 32 * PAGE_SIZE


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("n_choices")
    pool = f"--max_total_tokens={POOL_TOKENS}"
    s = Server("cpu.flags", *TEST_FLAGS, pool, log_path=str(tmp / "server.log"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(small):
    return openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)


def seed_of(seed: int, j: int) -> int:
    return (seed + j) % 2**32


def usable_prefix(prompt_len: int) -> int:
    """What a later identical prompt can take from the cache: full pages before its last token."""
    return (prompt_len - 1) // PAGE_SIZE * PAGE_SIZE


def fresh_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=length).tolist()


def check_no_leak(server) -> None:
    r = server.client.post("/flush_cache")  # idle: every page free, or a 500 naming the leak
    assert r.status_code == 200, r.text


def sse_payloads(server, path: str, body: dict) -> list[dict]:
    with server.client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# ---- /generate: the recompute reference, under concurrency and eviction -----------------------
case = st.fixed_dictionaries(
    {
        "prompt": st.builds(fresh_prompt, st.integers(0, 2**16), st.integers(2, 120)),
        "n": st.integers(2, 4),
        "seed": st.integers(0, 2**64 - 1),  # S + j may pass 2**64: the seed is used modulo 2**32
        "max_new_tokens": st.integers(1, 16),
        "temperature": st.sampled_from([0.7, 1.0, 1.5]),
        "top_k": st.sampled_from([-1, 20]),
    }
)


def _params(c: dict, seed: int, **extra) -> dict:
    keys = ("max_new_tokens", "temperature", "top_k")
    return dict({k: c[k] for k in keys}, seed=seed, ignore_eos=True, **extra)


def check_choices_are_single_requests(server, cases: list[dict]) -> None:
    """Every case's n choices at once, then the reference: each choice alone, from a flushed
    cache (every prompt computed anew), all at once too."""
    bodies = [{"input_ids": c["prompt"], "sampling_params": _params(c, c["seed"], n=c["n"])} for c in cases]
    singles = [
        {"input_ids": c["prompt"], "sampling_params": _params(c, seed_of(c["seed"], j))}
        for c in cases
        for j in range(c["n"])
    ]

    def generate(body: dict):  # a connection each: a pooled one idle past uvicorn's keep-alive may reset
        r = httpx.post(server.url + "/generate", json=body, timeout=wait(300))
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(generate, bodies))
        check_no_leak(server)
        want = iter(pool.map(generate, singles))
    for c, outs in zip(cases, got):
        assert isinstance(outs, list) and len(outs) == c["n"]
        for out in outs:
            assert out["output_ids"] == next(want)["output_ids"]
            assert out["meta_info"]["prompt_tokens"] == len(c["prompt"])
    check_no_leak(server)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases=st.lists(case, min_size=2, max_size=3))
def test_each_choice_is_the_single_request_with_its_seed(small, cases):
    check_choices_are_single_requests(small, cases)


def test_choices_under_memory_pressure(small):
    """12 choices growing to 8 pages each on a 32-page pool: running requests are retracted
    (and their pages evicted) and resume; outputs stay those of the single requests."""
    before = small.metrics()["hicache_num_retractions_total"]
    cases = [
        {"prompt": fresh_prompt(100 + i, 20), "n": 4, "seed": i, "max_new_tokens": 100, "temperature": 1.0}
        for i in range(3)
    ]
    check_choices_are_single_requests(small, [dict(c, top_k=-1) for c in cases])
    assert small.metrics()["hicache_num_retractions_total"] > before


def test_seeded_is_reproducible_and_choices_differ(small):
    body = {"input_ids": fresh_prompt(1, 40), "sampling_params": {"n": 4, "seed": 7, "max_new_tokens": 8}}
    ids = [tuple(o["output_ids"]) for o in small.generate(**body)]
    assert [tuple(o["output_ids"]) for o in small.generate(**body)] == ids
    assert len(set(ids)) == 4, ids
    unseeded = small.generate(input_ids=fresh_prompt(2, 40), sampling_params={"n": 4, "max_new_tokens": 8})
    assert len({tuple(o["output_ids"]) for o in unseeded}) > 1  # independent draws


def test_prompt_is_computed_once(small):
    prompt = fresh_prompt(3, 50)
    before = small.metrics()
    outs = small.generate(input_ids=prompt, sampling_params={"n": 4, "max_new_tokens": 3, "seed": 1})
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached == [0] + [usable_prefix(len(prompt))] * 3
    after = small.metrics()
    grew = after["hicache_cached_tokens_total"] - before["hicache_cached_tokens_total"]
    assert grew == 3 * usable_prefix(len(prompt))
    # Prompt-major order and derived rids: choice j of prompt i is output i * n + j.
    outs = small.generate(
        input_ids=[fresh_prompt(4, 20), fresh_prompt(5, 30)],
        sampling_params={"n": 2, "max_new_tokens": 1},
        rid=["a", "b"],
    )
    assert [o["meta_info"]["id"] for o in outs] == ["a_0", "a_1", "b_0", "b_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [20, 20, 30, 30]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 16, 0, 16]


def test_generate_stream_indexes_choices(small):
    body = {"input_ids": fresh_prompt(6, 25), "sampling_params": {"n": 3, "seed": 11, "max_new_tokens": 6}}
    whole = small.generate(**body)
    events = sse_payloads(small, "/generate", dict(body, stream=True))
    assert {e["index"] for e in events} == {0, 1, 2}
    for j, out in enumerate(whole):
        last = [e for e in events if e["index"] == j][-1]  # cumulative: the last is the whole
        assert last["output_ids"] == out["output_ids"] and last["text"] == out["text"]
        assert last["meta_info"]["finish_reason"]["type"] == "length"


# ---- OpenAI -----------------------------------------------------------------------------------
def test_completions_n_over_prompts(small, client):
    prompts = [fresh_prompt(7, 33), fresh_prompt(8, 18)]
    out = client.completions.create(model=MODEL, prompt=prompts, n=3, seed=5, max_tokens=5, best_of=3)
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        prompt, j = prompts[c.index // 3], c.index % 3
        ref = small.generate(input_ids=prompt, sampling_params={"seed": seed_of(5, j), "max_new_tokens": 5})
        assert c.text == ref["text"]
    # Each prompt counts once, with its first choice's cached tokens (none: fresh prompts).
    assert out.usage.prompt_tokens == 33 + 18 and out.usage.completion_tokens == 6 * 5
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompts, n=3, seed=5, max_tokens=5)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert again.usage.prompt_tokens_details.cached_tokens == usable_prefix(33) + usable_prefix(18)


def test_completions_stream_indexes_choices(small, client):
    kw = dict(model=MODEL, prompt=fresh_prompt(9, 21), n=3, seed=2**40, max_tokens=6)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == 21


def test_chat_n_and_stream(small, client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Pick a number"}], max_tokens=6, seed=3)
    out = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        ref = client.chat.completions.create(**dict(kw, seed=seed_of(3, c.index)))
        assert c.message.content == ref.choices[0].message.content
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens and out.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(n=3, stream=True, **kw))
    roles = [c.index for chunk in chunks for c in chunk.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in out.choices}


# ---- refusals, aborts, leaks ------------------------------------------------------------------
COMPLETION = {"model": MODEL, "prompt": "a", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}


@pytest.mark.parametrize(
    "path,body,words",
    [
        ("/v1/completions", dict(COMPLETION, n=0), "n must be >= 1"),
        ("/v1/completions", dict(COMPLETION, n=-3), "n must be >= 1"),
        ("/v1/completions", dict(COMPLETION, n="2"), "n"),
        ("/v1/completions", dict(COMPLETION, n=1.5), "n"),
        ("/v1/completions", dict(COMPLETION, n=True), "n"),
        ("/v1/completions", dict(COMPLETION, n=5000), "n=5000"),
        ("/v1/completions", dict(COMPLETION, prompt=["a"] * 600, n=2), "n=2 for 600 prompt(s)"),
        ("/v1/completions", dict(COMPLETION, n=2, best_of=1), "best_of must be >= n"),
        ("/v1/completions", dict(COMPLETION, n=2, best_of=3), "not supported"),
        ("/v1/chat/completions", dict(CHAT, n=0), "n must be >= 1"),
        ("/generate", {"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ("/generate", {"text": "a", "sampling_params": {"n": "2"}}, "sampling_params.n"),
        ("/generate", {"text": "a", "sampling_params": {"n": 2000}}, "sampling_params.n"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params.n"),
        ("/generate", {"text": "a", "sampling_params": {"n": 2, "seed": 2**64}}, "seed"),
        ("/generate", {"text": ["a", "b"], "stream": True, "sampling_params": {"n": 2}}, "single prompt"),
    ],
)
def test_bad_n_is_a_400_naming_the_field(small, path, body, words):
    r = small.client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_a_refused_choice_queues_none(small):
    body = {"input_ids": [[1, 2, 3], [1] * POOL_TOKENS]}  # the second prompt cannot fit
    r = small.client.post("/generate", json=dict(body, sampling_params={"n": 2, "max_new_tokens": 4}))
    assert r.status_code == 400 and "request 2: " in r.json()["error"]["message"], r.text
    check_no_leak(small)


def test_disconnect_aborts_every_choice(small):
    before = small.metrics()["hicache_aborted_requests_total"]
    params = {"n": 3, "max_new_tokens": 400, "ignore_eos": True}
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": params, "stream": True}
    with small.client.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # choice 0 has a token: the others are admitted or about to be
        assert small.client.post("/pause_generation").status_code == 200
        try:
            r.close()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                m = small.metrics()
                if m["hicache_aborted_requests_total"] >= before + 3:
                    break
                time.sleep(0.05)
            assert m["hicache_aborted_requests_total"] == before + 3, small.log_tail()
            assert m["hicache_num_running_reqs"] == 0 and m["hicache_num_waiting_reqs"] == 0
        finally:
            assert small.client.post("/continue_generation").status_code == 200
    check_no_leak(small)
