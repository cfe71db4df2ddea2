"""Streaming as deltas: the HTTP app and engine loop in-process, over an engine that follows a
script of tokens (so a character can be made to arrive split over byte-level tokens), and the
pieces (delta coalescing, cumulative /generate events, the Prometheus rendering) alone."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from hicache_jax.config import EngineConfig
from hicache_jax.engine.detokenizer import REPLACEMENT
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.outputs import OutputStream, format_output
from hicache_jax.metric_kinds import Metrics
from hicache_jax.models.presets import TOKENIZER
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.request import Req, Status
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.server import metrics
from hicache_jax.server.app import create_app
from hicache_jax.server.chat_template import ChatTemplate
from hicache_jax.server.config import ServerConfig
from hicache_jax.server.engine_loop import EngineLoop
from hicache_jax.server.messages import Sink, Update
from hicache_jax.server.state import ServerState
from hicache_jax.server.streaming import CumulativeStream
from tests.server.fake_engine import FakeEngine

TEXT = "Hi 😀 世界, ok 😀!"  # 3- and 4-byte characters: spelled byte by byte by the tiny tokenizer
TOK = Tokenizer(TOKENIZER)
SCRIPT = TOK.encode(TEXT, add_special_tokens=False)


def test_the_script_splits_characters():
    assert TOK.decode(SCRIPT) == TEXT
    assert sum(TOK.token_text(t) == REPLACEMENT for t in SCRIPT) >= 6  # bytes of cut characters


def _logprob(n: int, tok: int, k: int):
    top = [(-0.25 - n / 8, tok), (-4.0 - n, 7), (-5.0 - n, 8)][:k] if k else None
    return (-0.25 - n / 8, top)


class ScriptedEngine(FakeEngine):
    """The slice of ``Engine`` the loop uses: each step appends the script's next token (and
    made-up logprobs) to every request. Stop strings, lengths and outputs are the real
    ``Engine``'s code."""

    output = Engine.output
    pop_output = Engine.pop_output
    _stop_reason = Engine._stop_reason

    def __init__(self, tokenizer: Tokenizer, script: list[int]):
        self.tokenizer, self.script = tokenizer, script
        self.requests: dict[str, Req] = {}
        self.stats = {"generated_tokens": 0}
        self.model = SimpleNamespace(cfg=SimpleNamespace(eos_token_ids=()))
        self.context_len = 1 << 20

    def add_request(self, input_ids=None, text=None, sampling_params=None, *, rid, **kw) -> str:
        ids = input_ids or self.tokenizer.encode(text)
        self.requests[rid] = Req(rid, ids, SamplingParams.from_dict(sampling_params), **kw)
        return rid

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    def step(self) -> list[Req]:
        live = [r for r in self.requests.values() if not r.finished]
        now = time.monotonic()
        for req in live:
            n = len(req.output_ids)
            tok = self.script[n % len(self.script)]
            req.output_ids.append(tok)
            req.output_logprobs.append(_logprob(n, tok, req.top_logprobs_num))
            req.first_token_time = req.first_token_time or now
            reason = self._stop_reason(req, tok)
            if reason:
                req.status, req.finish_reason, req.finish_time = Status.FINISHED, reason, now
        self.stats["generated_tokens"] += len(live)
        time.sleep(0.002)  # a step takes time: the handler sees most of them one by one
        return live

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        req.status, req.finish_reason = Status.FINISHED, {"type": "abort"}
        return True

    def metrics(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def client():
    loop = EngineLoop(ScriptedEngine(TOK, SCRIPT))
    state = ServerState(
        loop=loop,
        engine_cfg=EngineConfig(),
        server_cfg=ServerConfig(),
        model_info={},
        chat=ChatTemplate(TOK),
        served_model_name="scripted",
        context_len=1 << 20,
        max_request_tokens=1 << 20,
        devices=[],
    )
    with TestClient(create_app(state), base_url="http://127.0.0.1") as c:  # a name the server answers to
        yield c


def events(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("stop", [None, "世"])
def test_generate_stream(client, stop):
    """SGLang's stream: each event holds the output so far; no event shows half a character."""
    sp = {"max_new_tokens": len(SCRIPT), "stop": [stop] if stop else []}
    body = {"text": "go", "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2}
    whole = client.post("/generate", json=body).json()
    got = events(client, "/generate", dict(body, stream=True))
    assert len(got) >= 2  # tokens arrive as they are made (a slow reader gets them joined)
    texts = [e["text"] for e in got]
    assert not any(REPLACEMENT in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # never takes text back
    final = got[-1]
    assert final["text"] == whole["text"] == (TEXT[: TEXT.find(stop)] if stop else TEXT)
    assert final["output_ids"] == whole["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs", "finish_reason", "completion_tokens"):
        assert final["meta_info"][key] == whole["meta_info"][key], key
    for e in got:  # every event: ids, logprobs and text agree
        assert len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"])
        assert TOK.decode(e["output_ids"]).startswith(e["text"])


@pytest.mark.parametrize("stop", [None, "世"])
def test_openai_completion_stream(client, stop):
    body = {"model": "scripted", "prompt": "go", "max_tokens": len(SCRIPT), "logprobs": 2, "stop": stop}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = [c["choices"][0] for c in events(client, "/v1/completions", dict(body, stream=True))]
    assert not any(REPLACEMENT in c["text"] for c in chunks)
    assert "".join(c["text"] for c in chunks) == whole["text"] == (TEXT[: TEXT.find(stop)] if stop else TEXT)
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):  # logprob deltas join to the whole
        assert [x for c in chunks for x in c["logprobs"][key]] == whole["logprobs"][key], key


def test_openai_chat_stream(client):
    body = {
        "model": "scripted",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": len(SCRIPT),
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    whole = client.post("/v1/chat/completions", json=dict(body, stream_options=None)).json()
    chunks = events(client, "/v1/chat/completions", dict(body, stream=True))
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    contents = [d["delta"].get("content") or "" for d in deltas]
    assert not any(REPLACEMENT in t for t in contents)
    assert "".join(contents) == whole["choices"][0]["message"]["content"] == TEXT
    joined = [x for d in deltas if d["logprobs"] for x in d["logprobs"]["content"]]
    assert joined == whole["choices"][0]["logprobs"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(SCRIPT)


# ---- the pieces alone ----------------------------------------------------------------------------
def _run(req: Req, stream: OutputStream, steps: int, top: int = 2):
    """Make ``steps`` tokens of the script; the deltas a streaming client would get."""
    deltas = []
    for n in range(steps):
        tok = SCRIPT[n]
        req.output_ids.append(tok)
        req.output_logprobs.append(_logprob(n, tok, top))
        if n == steps - 1:
            req.status, req.finish_reason = Status.FINISHED, {"type": "length", "length": steps}
        deltas.append(stream.next(req))
    return deltas


def _req(**kw) -> Req:
    req = Req("r", [5, 6, 7, 8], SamplingParams(), return_logprob=True, top_logprobs_num=2, **kw)
    req.input_logprobs = {1: (-1.0, [(-1.0, 6)]), 2: (-2.0, [(-0.5, 3)]), 3: (-3.0, None)}
    return req


def test_deltas_join_to_the_whole_output():
    req = _req(logprob_start_len=1)
    deltas = _run(req, OutputStream(req, TOK), len(SCRIPT))
    joined = deltas[0]
    for d in deltas[1:]:
        joined.extend(d)
    got, want = joined.as_dict(), format_output(req, TOK)
    got["meta_info"].pop("e2e_latency"), want["meta_info"].pop("e2e_latency")
    assert got == want


def test_cumulative_events_are_the_output_so_far():
    """Each /generate event equals the whole output of the deltas up to it, as plain JSON."""
    req = _req(logprob_start_len=2)
    cumulative, joined = CumulativeStream(), None
    for d in _run(req, OutputStream(req, TOK), len(SCRIPT)):
        event = cumulative.event(d)
        if joined is None:
            joined = d
        else:
            joined.extend(d)
        want = joined.as_dict()
        assert json.loads(event.removeprefix(b"data: ")) == json.loads(json.dumps(want))


def test_a_slow_reader_gets_the_deltas_joined():
    async def scenario():
        req = _req()
        sink = Sink("r")
        deltas = _run(req, OutputStream(req, TOK), len(SCRIPT))
        for d in deltas[:-1]:
            sink.queue.put_nowait(Update(d, finished=False))
        sink.queue.put_nowait(Update(deltas[-1], finished=True))
        assert sink.queue.qsize() == 2  # one joined partial delta, then the final one
        first, last = sink.queue.get_nowait(), sink.queue.get_nowait()
        assert first.out.text + last.out.text == TEXT
        assert first.out.output_ids + last.out.output_ids == SCRIPT
        assert len(first.out.logprobs) == len(first.out.output_ids) == len(SCRIPT) - 1

    asyncio.run(scenario())


def test_metrics_types_and_names():
    numbers = Metrics().counters({"generated_tokens": 5, "l3_writes": 3})
    numbers.gauges({"num_running_reqs": 2, "l3_pending_writes": 1, "new_thing": 1.5})
    text = metrics.render(numbers).decode()
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            types[name.removesuffix("_total")] = kind
    assert types["hicache_generated_tokens"] == "counter" and "hicache_generated_tokens_total 5.0" in text
    assert types["hicache_num_running_reqs"] == "gauge"
    assert types["hicache_l3_writes"] == "counter" and types["hicache_l3_pending_writes"] == "gauge"
    assert "hicache_new_thing 1.5" in text  # any declared key: metrics.py need not know it
    assert 'hicache_cache_tier_hit_rate{tier="device"} 0.0' in text


# ---- stream_options, as OpenAI and vLLM define them ----------------------------------------------
CHAT_GO = {"model": "scripted", "messages": [{"role": "user", "content": "go"}], "max_tokens": 6}
COMPLETE_GO = {"model": "scripted", "prompt": "go", "max_tokens": 6}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT_GO), ("/v1/completions", COMPLETE_GO)])
def test_stream_options_need_stream(client, path, body):
    r = client.post(path, json=dict(body, stream_options={"include_usage": True}))
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    assert client.post(path, json=dict(body, stream_options=None)).status_code == 200


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT_GO), ("/v1/completions", COMPLETE_GO)])
@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_stats(client, path, body, include_usage):
    """Usage so far in every chunk (vLLM's ``continuous_usage_stats``); ``include_usage`` adds
    the usage-only last chunk either way."""
    opts = {"continuous_usage_stats": True, "include_usage": include_usage}
    chunks = events(client, path, dict(body, stream=True, stream_options=opts))
    assert all("usage" in c for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0 for c in chunks)
    assert (chunks[-1]["choices"] == []) == include_usage


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT_GO), ("/v1/completions", COMPLETE_GO)])
def test_include_usage_alone_is_the_last_chunk(client, path, body):
    chunks = events(client, path, dict(body, stream=True, stream_options={"include_usage": True}))
    assert [("usage" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
