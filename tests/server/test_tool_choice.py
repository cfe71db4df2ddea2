"""The request side of function calling (``server/tool_choice.py``): what each
``tool_choice`` adds to the sampling params, and the output turned into OpenAI
``tool_calls`` the same way whole and streamed, for every format (generated calls rendered
by the parser tests' renderers) and for the grammar-held modes."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.sampling_params import InvalidRequest
from hicache_jax.server import tool_choice
from hicache_jax.server.tools.formats import ToolFormat
from tests.server.test_tool_parsers import chunks, outputs

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
    for n in ("a", "b_c")
]


def streamed(plan: tool_choice.ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    s = plan.stream()
    deltas = [d for p in pieces for d in s.feed(p)] + s.close()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert s.calls == len(calls)
    return content, calls


def _strip(calls):
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("fmt", list(ToolFormat))
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_auto_whole_equals_streamed(fmt, data):
    out, generated, content = data.draw(outputs(fmt))
    plan = tool_choice.plan(TOOLS, "auto", None, fmt)
    whole_content, whole_calls = plan.split(out)
    got_content, got_calls = streamed(plan, chunks(data.draw, out))
    assert [c["function"]["name"] for c in whole_calls] == [n for n, _ in generated]
    assert _strip(got_calls) == _strip(whole_calls)
    assert got_content == content and (whole_content or "") == content
    assert all(c["id"].startswith("call_") for c in whole_calls)
    assert plan.finish_reason("stop", bool(whole_calls)) == "tool_calls"


def test_required_and_named_grammars_validate_their_calls():
    required = tool_choice.plan(TOOLS, "required", False, None)
    schema = json.loads(required.sampling_params()["json_schema"])
    calls = [{"name": "b_c", "parameters": {}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls * 2, schema)  # parallel_tool_calls=false: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "zzz", "parameters": {}}], schema)
    content, out = required.split(json.dumps(calls))
    assert content is None and _strip(out) == [("function", "b_c", "{}")]
    named = tool_choice.plan(TOOLS, {"type": "function", "function": {"name": "a"}}, None, None)
    assert json.loads(named.sampling_params()["json_schema"]) == TOOLS[0]["function"]["parameters"]
    assert _strip(named.split("{}")[1]) == [("function", "a", "{}")]
    assert named.finish_reason("stop", True) == "stop"
    assert required.split('[{"name": "a", "para')[1] == []  # cut before its parameters: no call
    for plan in (required, named):
        whole = plan.split(json.dumps(calls) if plan is required else "{}")
        assert _strip(
            streamed(
                plan, ["[{", '"name": "b_c", "param', 'eters": {}}]'] if plan is required else ["{", "}"]
            )[1]
        ) == _strip(whole[1])


ARGS = st.dictionaries(
    st.sampled_from(["x", "y z", "é"]),
    st.recursive(st.integers() | st.text(max_size=4), lambda v: st.lists(v, max_size=2), max_leaves=4),
    max_size=3,
)


@settings(max_examples=50, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["a", "b_c"]), ARGS), min_size=1, max_size=3), data=st.data())
def test_cut_short_calls_are_the_text_so_far(calls, data):
    """Cut anywhere (max_tokens), a named output is one call whose arguments are the text so
    far; a required one gives each call whose parameters began, the last with its arguments'
    text so far (the text written as the grammar writes it: ", " and ": " separators)."""
    text, spans = "[", []  # spans: each call's name and where its arguments' text lies
    for k, (name, args) in enumerate(calls):
        text += ", " * (k > 0) + f'{{"name": "{name}", "parameters": '
        start = len(text)
        text += json.dumps(args, ensure_ascii=False)
        spans.append((name, start, len(text)))
        text += "}"
    text += "]"
    cut = data.draw(st.integers(0, len(text)))
    want = [(name, text[start : min(cut, stop)]) for name, start, stop in spans if cut > start]
    required = tool_choice.plan(TOOLS, "required", None, None)
    content, got = required.split(text[:cut])
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in got] == want
    assert _strip(streamed(required, chunks(data.draw, text[:cut]))[1]) == _strip(got)
    named = tool_choice.plan(TOOLS, {"type": "function", "function": {"name": "b_c"}}, None, None)
    args = json.dumps(calls[0][1], ensure_ascii=False)[: data.draw(st.integers(0, 99))]
    assert _strip(named.split(args)[1]) == [("function", "b_c", args)]
    for plan in (required, named):
        assert plan.finish_reason("length", True) == "length"


def test_none_and_unknown_format_are_plain_content():
    for plan in (
        tool_choice.plan(TOOLS, "none", None, ToolFormat.HERMES),
        tool_choice.plan(TOOLS, "auto", None, None),
    ):
        text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
        assert plan.split(text) == (text, [])
        assert plan.sampling_params() == {}
    assert tool_choice.plan(None, None, None, None) is None
    assert tool_choice.plan(TOOLS, "auto", None, ToolFormat.HARMONY).sampling_params() == {
        "skip_special_tokens": False
    }


def test_history_arguments_reach_templates_as_objects():
    m = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}],
    }
    assert tool_choice.template_message(m)["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    with pytest.raises(InvalidRequest, match="parallel_tool_calls"):
        tool_choice.plan(TOOLS, "auto", "yes", None)
