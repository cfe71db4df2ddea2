"""Function calling through the official ``openai`` client, on each family's chat template
(Llama 3 JSON, Mistral, Hermes/Qwen, gpt-oss harmony), served by the real server with
``--chat_template``: ``tool_choice: required`` and a named function always give parsed
``tool_calls`` that validate against the tools' parameters, streaming and not, with tools
and a tool-call history in the prompt; bad tool settings are 400s."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

from tests.server.conftest import TEST_FLAGS, Server

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
TEMPLATES = {
    "llama3_json": os.path.join(DATA, "tool_templates", "llama3_json.jinja"),
    "mistral": os.path.join(DATA, "tool_templates", "mistral.jinja"),
    "hermes": os.path.join(DATA, "tool_templates", "hermes.jinja"),
    "harmony": os.path.join(DATA, "gpt_oss_chat_template.jinja"),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8, "description": "City name"},
                "unit": {"enum": ["celsius", "fahrenheit"], "description": "Unit"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a UTC offset",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "integer", "minimum": -12, "maximum": 14, "description": "UTC offset"}
            },
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HISTORY = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "user", "content": "And the time there?"},
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"tools-{request.param}")
    flags = (*TEST_FLAGS, "--max_running_requests=4", f"--chat_template={TEMPLATES[request.param]}")
    server = Server("cpu.flags", *flags, log_path=str(tmp / "server.log"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield request.param, server, client
    finally:
        server.close()


def _create(client, stream: bool, **kw):
    kw = {"model": "tiny", "messages": HISTORY, "tools": TOOLS, "max_tokens": 300} | kw
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, choice.message.tool_calls, choice.finish_reason
    calls, content, reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            calls.setdefault(c.index, c)
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


def _check(calls, names):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named(family, stream):
    name, server, client = family
    for seed in range(3):
        content, calls, reason = _create(client, stream, tool_choice="required", temperature=1.0, seed=seed)
        _check(calls, SCHEMAS)
        assert reason == "tool_calls" and not content, (name, content, reason)
        one = _create(client, stream, tool_choice="required", parallel_tool_calls=False, seed=seed)
        _check(one[1], SCHEMAS)
        assert len(one[1]) == 1
        named = {"type": "function", "function": {"name": "get_time"}}
        content, calls, reason = _create(client, stream, tool_choice=named, temperature=1.0, seed=seed)
        _check(calls, {"get_time"})
        assert len(calls) == 1 and reason == "stop" and not content, (name, reason)


def test_tools_reach_the_template_and_none_is_plain(family):
    name, server, client = family
    kw = dict(model="tiny", messages=HISTORY, max_tokens=8, temperature=0)
    with_tools = client.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    without = client.chat.completions.create(**kw)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens  # the tool list is in the prompt
    assert with_tools.choices[0].message.tool_calls is None


NOTE_TEXT = "note " * 60  # 300 characters; the tiny vocabulary's longest piece has 7
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"const": NOTE_TEXT}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_cut_by_max_tokens_still_calls(server, stream):  # the shared server: the grammar holds any template
    """A call cut by max_tokens is still a call, as vLLM answers: named, the arguments so far;
    required, each call whose parameters began. The grammar forces every character here, so
    the whole arguments are known, and 40 tokens (at most 280 characters) cannot finish them."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    whole = json.dumps({"text": NOTE_TEXT})
    named = {"type": "function", "function": {"name": "note"}}
    messages = [{"role": "user", "content": "Take a note."}]
    for choice in (named, "required"):
        content, calls, reason = _create(
            client, stream, messages=messages, tools=[NOTE], tool_choice=choice, max_tokens=40, temperature=0
        )
        assert reason == "length" and not content, (choice, content, reason)
        assert [(c.type, c.function.name) for c in calls] == [("function", "note")], calls
        args = calls[0].function.arguments
        assert calls[0].id.startswith("call_") and args and whole.startswith(args) and args != whole, args


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "both constrain",
        ),
    ],
)
def test_bad_tool_settings_are_400s(server, extra, named):  # the shared server: any template
    body = {"model": "tiny", "messages": HISTORY, "max_tokens": 4, **extra}
    r = server.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"], r.text
