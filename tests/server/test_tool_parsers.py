"""Tool-call parsing (``hicache_jax.server.tools``), as properties: calls are generated, written
out in each family's syntax by a renderer here, cut into deltas at random points, and must
come back as the same calls and content, from ``parse`` and from ``StreamParser`` alike.
Arbitrary text made of marker fragments must never raise and must stream as it parses. Then
format names, detection, and the test chat templates in ``tests/data/tool_templates``, whose
rendered calls must parse back with the parser for their family."""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hicache_jax.server.chat_template import ChatTemplate
from hicache_jax.server.tools import formats
from hicache_jax.server.tools.formats import ToolFormat
from hicache_jax.server.tools.parsers import CallDelta, ContentDelta, Parsed, StreamParser, ToolCall, parse

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HARMONY_MARKER = re.compile(r"<\|[a-z0-9_]+\|>")

# ---- generated calls -------------------------------------------------------------------------
# Strings lean on the characters that matter to the parsers (brackets, quotes, markers' starts).
char = st.one_of(st.sampled_from(list('<>/|{}[]"\\;:,_= \n')), st.characters(codec="utf-8"))
text = st.text(char, max_size=12)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(text, values, max_size=4)
call_lists = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
space = st.sampled_from(["", " ", "\n", "\n\n"])


def dump(draw, value) -> str:
    """JSON as a model might space it."""
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])))


def render_hermes(draw, generated):
    contents = [draw(text) for _ in range(len(generated) + 1)]
    assume(not any("<tool_call>" in c for c in contents))
    out = contents[0]
    for i, (name, args) in enumerate(generated):
        as_string = draw(st.booleans())  # some models write the arguments as a JSON string
        body = {"name": name, "arguments": json.dumps(args) if as_string else args}
        last = i == len(generated) - 1 and not contents[-1].strip()
        close = "" if last and draw(st.booleans()) else "</tool_call>"  # cut off before the tag
        out += "<tool_call>" + draw(space) + dump(draw, body) + draw(space) + close + contents[i + 1]
    return out, "".join(contents)


def render_mistral(draw, generated):
    content = draw(text)
    assume("[TOOL_CALLS]" not in content)
    if draw(st.booleans()):  # v3: one JSON array
        items = [{"name": n, "arguments": a, "id": "a1B2c3D4e"} for n, a in generated]
        return content + "[TOOL_CALLS]" + draw(space) + dump(draw, items), content
    out = content
    for name, args in generated:  # v11+: name[ARGS]{...} per call, v13 with a call id
        call_id = (
            "[CALL_ID]" + draw(st.from_regex(r"[A-Za-z0-9]{9}", fullmatch=True))
            if draw(st.booleans())
            else ""
        )
        out += "[TOOL_CALLS]" + name + call_id + "[ARGS]" + dump(draw, args)
    return out, content


def render_llama3(draw, generated):
    key = draw(st.sampled_from(["parameters", "arguments"]))
    objects = [dump(draw, {"name": n, key: a}) for n, a in generated]
    joined = draw(st.sampled_from([";", "; ", ";\n"])).join(objects)
    return draw(space) + draw(st.sampled_from(["", "<|python_tag|>"])) + joined + draw(space), ""


def render_harmony(draw, generated):
    """The output after the prompt's ``<|start|>assistant``: thinking, calls, a final answer."""
    messages, free = [], []  # free: the generated text in them, which must hold no marker
    if draw(st.booleans()):
        free.append(draw(text))
        messages.append("<|channel|>analysis<|message|>" + free[-1] + "<|end|>")
    for name, args in generated:
        if draw(st.booleans()):
            head = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
        else:
            head = f" to=functions.{name}<|channel|>commentary json"
        free.append(dump(draw, args))
        messages.append(head + "<|message|>" + free[-1] + "<|call|>")
    final = draw(text) if draw(st.booleans()) else ""
    if final:
        free.append(final)
        messages.append("<|channel|>final<|message|>" + final + "<|return|>")
    assume(not any(HARMONY_MARKER.search(part) for part in free))
    out = "<|start|>assistant".join(messages)
    if draw(st.booleans()):  # the stop token is not part of the output
        out = out.removesuffix("<|call|>").removesuffix("<|return|>")
    return out, final


RENDER = {
    ToolFormat.HERMES: render_hermes,
    ToolFormat.MISTRAL: render_mistral,
    ToolFormat.LLAMA3_JSON: render_llama3,
    ToolFormat.HARMONY: render_harmony,
}


@st.composite
def outputs(draw, fmt: ToolFormat):
    generated = draw(call_lists)
    out, content = RENDER[fmt](draw, generated)
    return out, generated, content.strip()


def chunks(draw, out: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(out)), max_size=10)))
    return [out[a:b] for a, b in zip([0, *cuts], [*cuts, len(out)])]


def stream(fmt: ToolFormat, pieces: list[str]) -> Parsed:
    """The events a stream sends, joined; each call's index must be its position."""
    parser = StreamParser(fmt)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.close()
    found = [e for e in events if isinstance(e, CallDelta)]
    assert [e.index for e in found] == list(range(len(found)))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return Parsed(content, tuple(ToolCall(e.name, e.arguments) for e in found))


def check_roundtrip(fmt: ToolFormat, data) -> None:
    out, generated, content = data.draw(outputs(fmt))
    parsed = parse(fmt, out)
    assert parsed.content == content
    assert [c.name for c in parsed.calls] == [n for n, _ in generated]
    for call, (_, args) in zip(parsed.calls, generated, strict=True):
        assert json.loads(call.arguments) == args
        assert call.arguments == json.dumps(args, ensure_ascii=False)
    assert stream(fmt, chunks(data.draw, out)) == parsed


@pytest.mark.parametrize("fmt", list(ToolFormat))
@SETTINGS
@given(data=st.data())
def test_generated_calls_parse_back(fmt, data):
    check_roundtrip(fmt, data)


# ---- arbitrary and malformed output ----------------------------------------------------------
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_",
    "<|python_tag|>", "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>",
    "<|return|>", "<|constrain|>", "<|", "final", "analysis", " to=functions.f", " json",
    "{", "}", "[", "]", '"', '"name"', '"arguments"', '"parameters"', ":", ",", ";", " ", "\n",
    '"f"', "1", "\\", "x",
]  # fmt: skip
soup = st.lists(st.sampled_from(FRAGMENTS) | char, max_size=40).map("".join)


@pytest.mark.parametrize("fmt", list(ToolFormat))
@SETTINGS
@given(data=st.data())
def test_any_text_streams_as_it_parses(fmt, data):
    """Whatever the model writes: no exception, every split streams alike, and where nothing
    was a call, nothing was lost (harmony drops its analysis channel by design)."""
    out = data.draw(soup)
    parsed = parse(fmt, out)
    assert stream(fmt, chunks(data.draw, out)) == parsed
    if not parsed.calls and fmt is not ToolFormat.HARMONY:
        assert parsed.content == out.strip()


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def corrupt(draw, value) -> str:
    """``value`` as JSON with one character dropped, or a stray one put in, that no longer
    parses."""
    valid = json.dumps(value)
    at = draw(st.integers(0, len(valid) - 1))
    if draw(st.booleans()):
        broken = valid[:at] + valid[at + 1 :]
    else:
        broken = valid[:at] + draw(st.sampled_from(list(',:"{}[]x'))) + valid[at:]
    assume(not is_json(broken))
    return broken


@pytest.mark.parametrize("fmt", list(ToolFormat))
@SETTINGS
@given(data=st.data())
def test_malformed_call_is_content(fmt, data):
    name, args = data.draw(call_lists)[0]
    if fmt is ToolFormat.HARMONY:
        body = corrupt(data.draw, args)
        assume(not HARMONY_MARKER.search(body))
        out = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{body}<|call|>"
        expected = body.strip()  # the arguments, as text; the headers are no content
    else:
        if fmt is ToolFormat.HERMES:
            out = "<tool_call>\n" + corrupt(data.draw, {"name": name, "arguments": args}) + "\n</tool_call>"
        elif fmt is ToolFormat.MISTRAL:  # the object broken, not the list: one object is a call too
            out = "[TOOL_CALLS][" + corrupt(data.draw, {"name": name, "arguments": args}) + "]"
        else:
            out = corrupt(data.draw, {"name": name, "parameters": args})
        expected = out.strip()  # all of it, markers included
    parsed = parse(fmt, out)
    assert parsed == Parsed(expected, ())
    assert stream(fmt, chunks(data.draw, out)) == parsed


@pytest.mark.parametrize(
    "fmt, out",
    [
        (ToolFormat.HERMES, '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),
        (ToolFormat.HERMES, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
        (ToolFormat.HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),
        (ToolFormat.HERMES, '<tool_call>\n{"name": "f"} and more\n</tool_call>'),
        (ToolFormat.MISTRAL, "[TOOL_CALLS]get weather[ARGS]{}"),
        (ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"arguments": {}}]'),
        (ToolFormat.LLAMA3_JSON, '{"name": "Ada", "age": 36}'),  # a JSON answer, not a call
        (ToolFormat.LLAMA3_JSON, '{"name": "f", "parameters": {}} trailing'),
    ],
)
def test_not_a_call_is_content(fmt, out):
    assert parse(fmt, out) == Parsed(out.strip(), ())


# ---- a few outputs written out ---------------------------------------------------------------
def test_harmony_examples():
    weather = ToolCall("get_weather", '{"city": "Paris"}')
    thinking = "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    assert parse(ToolFormat.HARMONY, thinking + call + "<|call|>") == Parsed("", (weather,))
    before = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
    assert parse(ToolFormat.HARMONY, before) == Parsed("", (weather,))  # cut before <|call|>
    final = thinking + "<|channel|>final<|message|>Hello!<|return|>"
    assert parse(ToolFormat.HARMONY, final) == Parsed("Hello!", ())
    assert parse(ToolFormat.HARMONY, "no format at all<|end|>") == Parsed("no format at all", ())


def test_hermes_examples():
    out = 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"tag": "</tool_call>"}}\n</tool_call>\nDone.'
    assert parse(ToolFormat.HERMES, out) == Parsed(
        "Checking.\n\nDone.", (ToolCall("f", '{"tag": "</tool_call>"}'),)
    )


def feed_each(fmt: ToolFormat, deltas: list[str]) -> list[list]:
    parser = StreamParser(fmt)
    return [parser.feed(d) for d in deltas] + [parser.close()]


def test_content_streams_unless_it_may_start_a_call():
    assert feed_each(ToolFormat.HERMES, ["Hello wor", "ld <tool_", "call>", '{"name": "f"}']) == [
        [ContentDelta("Hello wor")],
        [ContentDelta("ld")],  # "<tool_" might be a marker, the space might end the content
        [],
        [],
        [CallDelta(0, "f", "{}")],
    ]
    assert feed_each(ToolFormat.HERMES, ["a <tool", "box>"]) == [
        [ContentDelta("a")],
        [ContentDelta(" <toolbox>")],
        [],
    ]
    assert feed_each(ToolFormat.LLAMA3_JSON, ["  Hi", " there"]) == [
        [ContentDelta("Hi")],
        [ContentDelta(" there")],
        [],
    ]
    assert feed_each(ToolFormat.LLAMA3_JSON, ['{"na', 'me": "x"}']) == [
        [],
        [],
        [ContentDelta('{"name": "x"}')],
    ]
    assert feed_each(ToolFormat.MISTRAL, ["Sure[TOOL", "S] ok"]) == [
        [ContentDelta("Sure")],
        [ContentDelta("[TOOLS] ok")],
        [],
    ]
    harmony = [
        "<|channel|>analysis<|message|>hm",
        "m<|end|><|start|>assistant<|channel|>final<|message|>Hel",
        "lo<|",
        "return|>",
    ]
    assert feed_each(ToolFormat.HARMONY, harmony) == [[], [ContentDelta("Hel")], [ContentDelta("lo")], [], []]


# ---- names and detection ---------------------------------------------------------------------
def test_parser_names():
    expected = {
        # SGLang's --tool-call-parser
        "llama3": ToolFormat.LLAMA3_JSON,
        "mistral": ToolFormat.MISTRAL,
        "qwen": ToolFormat.HERMES,
        "qwen25": ToolFormat.HERMES,
        "gpt-oss": ToolFormat.HARMONY,
        # vLLM's
        "llama3_json": ToolFormat.LLAMA3_JSON,
        "hermes": ToolFormat.HERMES,
        "openai": ToolFormat.HARMONY,
        # ours
        "qwen3": ToolFormat.HERMES,
        "harmony": ToolFormat.HARMONY,
    }
    assert {name: formats.from_name(name) for name in expected} == expected
    with pytest.raises(
        ValueError, match=r"unknown tool-call parser 'pythonic'; known: .*hermes.*llama3_json"
    ):
        formats.from_name("pythonic")


def test_special_tokens_kept_where_markers_are_special():
    assert {f for f in ToolFormat if formats.needs_special_tokens(f)} == {
        ToolFormat.HARMONY,
        ToolFormat.MISTRAL,
    }


def template_source(name: str) -> str:
    path = os.path.join(
        DATA, "gpt_oss_chat_template.jinja" if name == "harmony" else f"tool_templates/{name}.jinja"
    )
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_detect_from_template(fmt):
    assert formats.detect(template_source(fmt.value)) is fmt


def test_detect_nothing():
    assert formats.detect(None) is None
    assert formats.detect("") is None
    assert formats.detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    both = "<|channel|> ... <tool_call> ... [TOOL_CALLS] ... ipython"
    assert formats.detect(both) is ToolFormat.HARMONY  # harmony first


# ---- the test chat templates -----------------------------------------------------------------
class FakeTokenizer:
    has_text = True

    def __init__(self, source: str, bos: str, eos: str):
        self.config = {"chat_template": source, "bos_token": bos, "eos_token": eos}


# Each family's start and end of sequence, and what closes an assistant turn.
SPECIALS = {
    ToolFormat.LLAMA3_JSON: ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    ToolFormat.MISTRAL: ("<s>", "</s>", "</s>"),
    ToolFormat.HERMES: ("", "<|im_end|>", "<|im_end|>\n"),
    ToolFormat.HARMONY: ("<|startoftext|>", "<|return|>", "<|end|>"),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
ASK = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": 'Lyon, "FR" <b>'})]


def called(string_args: bool, calls=CALLS) -> dict:
    """The assistant's turn with two calls, arguments as dicts or as JSON strings (clients send
    either)."""
    tool_calls = [
        {
            "id": f"call{i}",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(a) if string_args else a},
        }
        for i, (n, a) in enumerate(calls)
    ]
    return {"role": "assistant", "content": None, "tool_calls": tool_calls}


RESULTS = [
    {"role": "tool", "tool_call_id": "call0", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call1", "content": '{"temp_c": 19}'},
    {"role": "assistant", "content": "Paris 21 C, Lyon 19 C."},
    {"role": "user", "content": "Thanks!"},
]


def chat(fmt: ToolFormat) -> ChatTemplate:
    bos, eos, _ = SPECIALS[fmt]
    return ChatTemplate(FakeTokenizer(template_source(fmt.value), bos, eos))


@pytest.mark.parametrize("fmt", [ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL, ToolFormat.HERMES])
def test_template_renders_tools_calls_and_results(fmt):
    template = chat(fmt)
    tools = {"tools": [WEATHER]}
    text = template.render(ASK + [called(False)] + RESULTS, True, tools)
    assert text == template.render(ASK + [called(True)] + RESULTS, True, tools)  # dict or string alike
    assert text.startswith(SPECIALS[fmt][0])
    assert "Answer briefly." in text and "Thanks!" in text and "Paris 21 C, Lyon 19 C." in text
    tool_json = json.dumps(WEATHER if fmt is not ToolFormat.LLAMA3_JSON else WEATHER["function"])
    if fmt is ToolFormat.LLAMA3_JSON:
        assert "Environment: ipython" in text and tool_json in text
        for result in RESULTS[:2]:
            assert f"<|start_header_id|>ipython<|end_header_id|>\n\n{result['content']}<|eot_id|>" in text
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    elif fmt is ToolFormat.MISTRAL:
        # the tools just before the last user turn, which carries the system prompt
        tools_json = json.dumps([WEATHER])
        assert (
            f"[AVAILABLE_TOOLS]{tools_json}[/AVAILABLE_TOOLS][INST] Answer briefly.\n\nThanks! [/INST]"
            in text
        )
        assert text.count("[AVAILABLE_TOOLS]") == 1
        for result in RESULTS[:2]:
            expected = {"content": result["content"], "call_id": result["tool_call_id"]}
            assert f"[TOOL_RESULTS]{json.dumps(expected)}[/TOOL_RESULTS]" in text
    else:
        system = text[: text.index("<|im_end|>")]
        assert (
            system.startswith("<|im_start|>system\nAnswer briefly.")
            and f"<tools>\n{tool_json}\n</tools>" in system
        )
        responses = "".join(f"<tool_response>\n{r['content']}\n</tool_response>\n" for r in RESULTS[:2])
        assert f"<|im_start|>user\n{responses}<|im_end|>" in text  # one user turn for both results
        assert text.endswith("<|im_start|>assistant\n")
    for variables in (None, {"tools": None}):  # no tools: the plain chat
        plain = template.render(ASK, True, variables)
        assert "get_weather" not in plain and "Weather in Paris and Lyon?" in plain


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_template_calls_parse_back(fmt):
    """An assistant turn's calls as the template writes them are what the model learns to write:
    the parser for the family must read them back."""
    template, tools = chat(fmt), {"tools": [WEATHER]}
    prompt = template.render(ASK, True, tools)
    # gpt-oss's published template writes one call per turn, and takes no None content
    calls = CALLS[:1] if fmt is ToolFormat.HARMONY else CALLS
    turn = called(False, calls)
    if fmt is ToolFormat.HARMONY:
        del turn["content"]
    whole = template.render(ASK + [turn], False, tools)
    assert whole.startswith(prompt)
    reply = whole[len(prompt) :]
    end = SPECIALS[fmt][2]
    assert reply.endswith(end)
    parsed = parse(fmt, reply.removesuffix(end))
    assert parsed == Parsed("", tuple(ToolCall(n, json.dumps(a)) for n, a in calls))
