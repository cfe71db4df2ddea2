"""Structured output through the real server: hypothesis generates JSON schemas (objects,
arrays, enums, nested, required fields, string patterns) and regexes, and every constrained
output parses and validates, over the OpenAI routes (``response_format``, SGLang's ``regex``
extension; the official client, streaming and not) and SGLang's ``/generate``
(``json_schema``), in concurrent batches that mix constrained and unconstrained rows (the
server runs the overlap schedule). The unconstrained outputs beside them are not valid JSON
for the schema: random weights left alone produce none. Bad grammars are 400s naming the
problem."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

MODEL = "tiny"
MAX_TOKENS = 400

PATTERNS = ["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]$", "^(ab|cd){1,2}$", "^x?[0-9a-f]{1,3}$"]
names = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
leaves = st.one_of(
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
    st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.lists(st.one_of(names, st.integers(-9, 99)), min_size=1, max_size=4, unique=True).map(
        lambda e: {"enum": e}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
)


@st.composite
def _objects(draw, children):
    props = draw(st.dictionaries(names, children, min_size=1, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _extend(children):
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 1)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1], "minItems": min(t[1], t[2])}
    )
    return st.one_of(arrays, _objects(children))


schemas = _objects(st.recursive(leaves, _extend, max_leaves=5))


def worst_chars(s: dict) -> int:
    """An upper bound of the compact JSON text of any instance (the tiny tokenizer spends
    at most one token per character), so a schema's output always fits MAX_TOKENS."""
    if "enum" in s:
        return max(len(json.dumps(v)) for v in s["enum"])
    t = s["type"]
    if t == "string":
        return 2 + 6 * (s.get("maxLength") or 8)
    if t == "array":
        return 2 + s["maxItems"] * (worst_chars(s["items"]) + 2)
    if t == "object":
        return 2 + sum(len(k) + 6 + worst_chars(v) for k, v in s["properties"].items())
    return {"integer": 4, "boolean": 5, "null": 4}[t]


atoms = st.tuples(
    st.sampled_from(["[a-z]", "[0-9]", "[A-F]", "x", "\\.", "-", "(ab|c)"]),
    st.sampled_from(["", "?", "{1,3}", "{2}"]),
).map("".join)
regexes = st.one_of(
    st.lists(atoms, min_size=1, max_size=4).map("".join),
    st.tuples(st.lists(atoms, min_size=1, max_size=3), st.lists(atoms, min_size=1, max_size=3)).map(
        lambda t: f"({''.join(t[0])}|{''.join(t[1])})"
    ),
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, schema, stream: bool, seed: int) -> tuple[str, str]:
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=MAX_TOKENS)
    kw.update(response_format=rf, temperature=[0.0, 1.0][seed % 2], seed=seed)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _completion_regex(client, regex, stream: bool, seed: int) -> tuple[str, str]:
    kw = dict(model=MODEL, prompt="code:", max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
    if not stream:
        c = client.completions.create(extra_body={"regex": regex}, **kw).choices[0]
        return c.text, c.finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, extra_body={"regex": regex}, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _generate(server, schema, seed: int) -> tuple[str, str]:
    sp = {"max_new_tokens": MAX_TOKENS, "json_schema": json.dumps(schema), "temperature": 0.8, "seed": seed}
    out = server.generate(text="JSON please:", sampling_params=sp)
    return out["text"], out["meta_info"]["finish_reason"]["type"]


def _plain_chat(client, seed: int) -> str:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=24, seed=seed)
    return client.chat.completions.create(**kw).choices[0].message.content


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, regex=regexes, seed=st.integers(0, 2**20))
def test_constrained_outputs_validate(server, client, schema, regex, seed):
    assume(worst_chars(schema) <= 300)
    re.compile(regex)
    calls = {
        "chat": lambda: _chat(client, schema, False, seed),
        "chat stream": lambda: _chat(client, schema, True, seed + 1),
        "completion regex": lambda: _completion_regex(client, regex, False, seed),
        "completion regex stream": lambda: _completion_regex(client, regex, True, seed + 1),
        "generate": lambda: _generate(server, schema, seed),
        "plain 1": lambda: _plain_chat(client, seed),
        "plain 2": lambda: _plain_chat(client, seed + 1),
    }
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        got = {name: f.result() for name, f in {n: pool.submit(c) for n, c in calls.items()}.items()}
    for name, out in got.items():
        if name.startswith("plain"):
            assert not _valid(out, schema), (name, out)
            continue
        text, reason = out
        assert reason == "stop", (name, text, reason)
        if "regex" in name:
            assert re.fullmatch(regex, text), (name, regex, text)
        else:
            assert _valid(text, schema), (name, json.dumps(schema), text)


def test_response_format_text_and_json_object(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    text = client.chat.completions.create(response_format={"type": "text"}, **kw).choices[0].message.content
    assert text == plain  # "text" is no constraint
    obj = client.chat.completions.create(
        response_format={"type": "json_object"}, **dict(kw, max_tokens=MAX_TOKENS, temperature=0.7, seed=4)
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
        "foo",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"regex": "[a-z"}, "regex"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex and ebnf"),
]


@pytest.mark.parametrize("extra, named", BAD)
def test_bad_grammars_are_400s(server, extra, named):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = server.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    "params, named",
    [
        ({"json_schema": "{not json"}, "json_schema: not valid JSON"),
        ({"json_schema": '{"type": "object", "required": 5}'}, "json_schema"),
        ({"regex": "(a"}, "regex"),
        ({"structural_tag": '{"structures": [], "triggers": []}'}, "structural_tag"),
        ({"regex": "a", "min_new_tokens": 2}, "min_new_tokens"),
    ],
)
def test_bad_generate_grammars_are_400s(server, params, named):
    r = server.client.post(
        "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, **params}}
    )
    assert r.status_code == 400, r.text
    assert named in r.text, r.text


def test_a_schema_compiles_once(server):
    schema = {"type": "object", "properties": {"q": {"enum": [1, 2, 3]}}, "required": ["q"]}
    sp = {"max_new_tokens": 30, "json_schema": json.dumps(schema), "temperature": 0}
    before = server.metrics()
    outs = [server.generate(text="x", sampling_params=sp) for _ in range(2)]
    after = server.metrics()
    assert all(json.loads(o["text"])["q"] in (1, 2, 3) for o in outs)
    assert after["hicache_grammar_compiles_total"] - before.get("hicache_grammar_compiles_total", 0) == 1
    # the handler's compile (off the engine thread) and the engine's copy: the rest hit
    assert after["hicache_grammar_cache_hits_total"] - before.get("hicache_grammar_cache_hits_total", 0) == 3
