"""The agent workload's parts without a server: its texts and tools, the benchmark's own
rendering of the server's prompt, the chat client's reading of a stream, and the report's
lines. (It runs against real servers in test_bench_smoke.py.)"""

import asyncio
import json

import httpx
import jsonschema
import pytest

from hicache_jax.bench import report
from hicache_jax.bench.agent_prompts import LocalChat, _JsonTokenizer, _preset_tokenizer, flag_value
from hicache_jax.bench.client import BenchClient, ServerInfo
from hicache_jax.bench.runner import WARMUP_SEED
from hicache_jax.bench.workloads import AgentConfig, agent_texts
from hicache_jax.server import tool_choice
from hicache_jax.server.chat_template import ChatTemplate
from tests.cache_rules import classic_rules
from tests.server.conftest import ROOT

HERMES = f"{ROOT}/tests/data/tool_templates/hermes.jinja"


def test_texts_follow_the_seed_and_the_warm_up_shares_nothing():
    cfg = AgentConfig(requests=20, tools=12)
    a, b = agent_texts(cfg, 0), agent_texts(cfg, 0)
    assert a[:3] == b[:3] and (a[3] == b[3]).all()
    system, tools, users, arrivals = a
    w_system, w_tools, w_users, _ = agent_texts(cfg, WARMUP_SEED)
    assert system != w_system and not set(users) & set(w_users)
    assert [t["function"] for t in tools] != [t["function"] for t in w_tools]
    assert len(set(users)) == 20 and len(system.split()) == cfg.system_words
    assert all(len(u.split()) == cfg.user_words for u in users)
    assert (arrivals[1:] > arrivals[:-1]).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tools_are_valid_openai_tools_with_json_schemas(seed):
    _, tools, _, _ = agent_texts(AgentConfig(tools=32), seed)
    names = [t["function"]["name"] for t in tools]
    assert len(names) == len(set(names)) == 32
    for t in tools:
        schema = t["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert set(schema["required"]) <= set(schema["properties"]) and schema["required"]
        assert len(t["function"]["description"].split()) >= 6
    # The server takes them, and builds the grammar of tool_choice=required from them.
    plan = tool_choice.plan(tools, "required", None, None)
    jsonschema.Draft202012Validator.check_schema(json.loads(plan.sampling_params()["json_schema"]))


def test_config_refuses_what_it_cannot_send():
    with pytest.raises(ValueError, match="tool_choice"):
        AgentConfig(tool_choice="any")
    with pytest.raises(ValueError, match="needs tools"):
        AgentConfig(tools=0, tool_choice="required")
    with pytest.raises(ValueError, match="concurrency"):
        AgentConfig(concurrency=0)


def test_flag_values_come_from_flagfiles_and_the_last_one_wins(tmp_path):
    inner = tmp_path / "inner.flags"
    inner.write_text("# a comment\n--chat_template=/from/inner\n--page_size=16\n")
    outer = tmp_path / "outer.flags"
    outer.write_text(f"--flagfile={inner}\n")
    assert flag_value([f"--flagfile={outer}"], "chat_template") == "/from/inner"
    assert flag_value([f"--flagfile={outer}", "--chat_template=/later"], "chat_template") == "/later"
    assert flag_value(["--chat_template", "/spaced", f"--flagfile={outer}"], "chat_template") == "/from/inner"
    assert flag_value(["--preset=tiny"], "chat_template") is None


@pytest.mark.parametrize("template", [None, HERMES])
def test_local_rendering_is_the_servers(template):
    """The benchmark's light tokenizer and the template it finds in the server flags give
    the ids the server's own ``ChatTemplate`` on its ``Tokenizer`` gives."""
    from hicache_jax.models.tokenizer import Tokenizer

    flags = ("--flagfile=configs/cpu.flags",) + ((f"--chat_template={template}",) if template else ())
    local = LocalChat.find({"has_tokenizer": True, "tokenizer_path": None, "preset": "tiny"}, flags)
    source = open(template).read() if template else None
    server = ChatTemplate(Tokenizer(_preset_tokenizer()), source)
    system, tools, users, _ = agent_texts(AgentConfig(requests=3, tools=3), 0)
    for u in users:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": u}]
        ids = local.encode(messages, tools)
        assert ids == server.encode(messages, True, {"tools": tools})
    with_tools = len(ids)
    assert (with_tools > len(local.encode(messages, None)) + 300) == bool(template)  # hermes writes them
    assert LocalChat.find({"has_tokenizer": False, "preset": "tiny"}, flags) is None
    assert LocalChat.find({"has_tokenizer": True, "tokenizer_path": "org/hub-id"}, flags) is None
    assert isinstance(local.chat.tokenizer, _JsonTokenizer)


def _sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _usage(prompt: int, completion: int, cached: int = 0, tiers=None) -> dict:
    details = {"cached_tokens": cached, "cached_tokens_details": tiers or {"device": cached}}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "prompt_tokens_details": details}


def _client(handler) -> BenchClient:
    client = BenchClient("http://bench.test", timeout_s=10)
    client.http = httpx.AsyncClient(base_url="http://bench.test", transport=httpx.MockTransport(handler))
    return client


def test_chat_reads_ttft_and_cached_tokens_from_the_usage():
    sent = []

    def handler(request):
        body = json.loads(request.content)
        sent.append(body)
        chunk = {"choices": [{"index": 0, "delta": {}}]}
        stream = _sse(
            {**chunk, "usage": _usage(6, 0)},  # a role chunk before any token: not the first token
            {**chunk, "usage": _usage(6, 1, 4, {"device": 3, "host": 1})},
            {**chunk, "usage": _usage(6, 2, 4, {"device": 3, "host": 1})},
        )
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    async def go():
        client = _client(handler)
        try:
            exact = await client.chat({"model": "m", "messages": [], "max_tokens": 2}, 1, [5, 6, 7, 8, 9, 10])
            other = await client.chat({"model": "m", "messages": [], "max_tokens": 2}, 2, [5, 6, 7])
            unknown = await client.chat({"model": "m", "messages": [], "max_tokens": 2}, 3)
        finally:
            await client.aclose()
        return exact, other, unknown

    exact, other, unknown = asyncio.run(go())
    assert sent[0]["stream"]
    assert sent[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert exact.ok and exact.first_token is not None and exact.ttft >= 0
    assert exact.prompt == (5, 6, 7, 8, 9, 10) and exact.exact_ids and len(exact.output) == 2
    assert exact.cached == 4 and exact.cached_tiers == {"device": 3, "host": 1, "storage": 0}
    # A rendering of another length is not the server's prompt: stand-ins, no maximum.
    for rec in (other, unknown):
        assert not rec.exact_ids and len(rec.prompt) == 6 and all(t < 0 for t in rec.prompt)
    stand_ins = [t for r in (exact, other, unknown) for t in r.output + (r.prompt if not r.exact_ids else ())]
    assert len(stand_ins) == len(set(stand_ins))

    rules = classic_rules(2)
    info = ServerInfo(rules, 64, 16, None, False)
    ph = report.summarize("run", [exact, other], 1.0, info)
    assert ph["exact_ids"] is False and ph["max_hit_rate"] is None and ph["hit_rate"] == 8 / 12
    ph = report.summarize("run", [exact], 1.0, info)  # exact ids: a maximum (0 for a lone request)
    assert ph["exact_ids"] and ph["max_cached_tokens"] == 0 and ph["requests_over_max"] == 1
    assert ph["prompt_tokens_per_request"] == {"min": 6, "p50": 6.0, "max": 6}


def test_chat_errors_are_recorded_not_raised():
    def handler(request):
        if json.loads(request.content)["model"] == "bad":
            return httpx.Response(400, json={"error": {"message": "no"}})
        return httpx.Response(200, content=_sse({"error": {"message": "engine failed"}}))

    async def go():
        client = _client(handler)
        try:
            return [await client.chat({"model": m, "messages": []}, 0) for m in ("bad", "good")]
        finally:
            await client.aclose()

    bad, failed = asyncio.run(go())
    assert not bad.ok and bad.error.startswith("HTTP 400")
    assert not failed.ok and "engine failed" in failed.error


def test_report_lines_give_prompt_sizes_and_ttft_against_no_cache():
    def phase(p50, p90, exact=True):
        return {
            "ttft_ms": {"p50": p50, "p90": p90, "p99": p90},
            "prompt_tokens_per_request": {"min": 100, "p50": 110.0, "max": 120},
            "exact_ids": exact,
        }

    results = {
        "none": {"label": "no prefix cache", "agent": [phase(1000.0, 2000.0)]},
        "l1": {"label": "L1", "agent": [phase(100.0, 500.0, exact=False)]},
    }
    lines = report._agent_lines(results)
    assert "- L1 over no prefix cache: TTFT p50 0.10x, p90 0.25x" in lines
    assert any("prompt tokens per request 100 / 110 / 120" in ln and "no maximum" in ln for ln in lines)
