"""Hostile HTTP input, fuzzed: whatever a client sends to ``/generate``, ``/v1/completions`` or
``/v1/chat/completions``, the answer is never a 5xx, every error is a JSON body in the
project's shape, the server logs no unexpected exception, and ``/health`` still answers.

Bodies are valid requests with fields replaced by junk (wrong types, huge and negative
numbers, NaN/inf, nested containers, unicode), arbitrary JSON values, arbitrary bytes, under
any content type. Requests that happen to be valid are capped at a few new tokens so the
run stays short; everything else about them is left as generated.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import CONTEXT
from tests.waits import wait

MODEL = "tiny"
EXAMPLES = 60  # per route; each example is one HTTP call (~10-100 ms)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
# Log lines that mean an exception escaped where it should not (even if answered with a 4xx).
BAD_LOG = ("unhandled error", "add_request failed", "engine step failed", "engine loop", "Traceback")

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**30, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "../../etc/passwd", "\u202e\u200b", "\U0001f600" * 50, "a" * 20000]),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)

SAMPLING_FIELDS = [
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "seed", "sampling_seed", "skip_special_tokens", "n", "bogus",
]  # fmt: skip
COMMON_OPENAI = [
    "model", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "ignore_eos",
    "stop_token_ids", "skip_special_tokens", "cache_salt", "max_tokens", "logprobs", "bogus",
]  # fmt: skip
ROUTES = {
    "/generate": (
        {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        ["text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
         "top_logprobs_num", "stream", "rid", "cache_salt", "bogus"],
    ),
    "/v1/completions": (
        {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        COMMON_OPENAI + ["prompt", "echo", "suffix", "best_of"],
    ),
    "/v1/chat/completions": (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        COMMON_OPENAI + ["messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"],
    ),
}  # fmt: skip
PARTS = st.lists(st.fixed_dictionaries({"type": JUNK, "text": JUNK}), max_size=2)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | JUNK},
        optional={
            "content": st.text(max_size=40) | JUNK | PARTS,
            "name": JUNK,
        },
    ),
    max_size=3,
)
CONTENT_TYPES = [
    "application/json", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/json; charset=latin-1", "",
]  # fmt: skip


@st.composite
def mutated(draw, route: str) -> dict:
    """The route's valid template with some fields dropped, some set to junk."""
    template, fields = ROUTES[route]
    body = dict(template)
    for name in draw(st.sets(st.sampled_from(sorted(body)), max_size=2)):
        del body[name]
    body.update(draw(st.dictionaries(st.sampled_from(fields), JUNK, max_size=3)))
    if route == "/generate" and draw(st.booleans()):
        sp = draw(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), JUNK, max_size=3))
        body["sampling_params"] = {"max_new_tokens": 2} | sp
    if route == "/v1/chat/completions" and draw(st.booleans()):
        body["messages"] = draw(MESSAGES)
    return body


# Values of the right type at the edges of their range: requests that get deep into the
# server (streaming, logprobs, stop strings, batches) instead of failing at the first check.
EDGE_INT = st.integers(-3, 40) | st.sampled_from([2**31, 2**63, -(2**63)])
EDGE_FLOAT = st.floats(-1, 3) | st.sampled_from([0.0, 1e-9, 1.0, 1.0000001, math.nan, math.inf])
TEXT = st.text(max_size=30)
STOPS = TEXT | st.lists(TEXT, max_size=3)
SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(0, 4)},
    optional={
        "temperature": EDGE_FLOAT, "top_p": EDGE_FLOAT, "top_k": EDGE_INT, "min_p": EDGE_FLOAT,
        "stop": STOPS, "stop_token_ids": st.lists(EDGE_INT, max_size=3), "ignore_eos": st.booleans(),
        "seed": EDGE_INT, "skip_special_tokens": st.booleans(),
    },
)  # fmt: skip
OPENAI_PLAUSIBLE = {
    "temperature": EDGE_FLOAT, "top_p": EDGE_FLOAT, "top_k": EDGE_INT, "min_p": EDGE_FLOAT,
    "n": EDGE_INT, "stream": st.booleans(), "stop": STOPS, "seed": EDGE_INT, "user": TEXT,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(EDGE_INT, max_size=3), "cache_salt": TEXT,
    "max_tokens": st.integers(0, 4) | EDGE_INT, "presence_penalty": EDGE_FLOAT,
}  # fmt: skip
PLAUSIBLE = {
    "/generate": {
        "text": TEXT | st.lists(TEXT, min_size=1, max_size=3),
        "input_ids": st.lists(st.integers(-1, 520), max_size=6)
        | st.lists(st.lists(st.integers(0, 511), max_size=4), max_size=3),
        "sampling_params": SAMPLING | st.lists(SAMPLING, max_size=3),
        "return_logprob": st.booleans(), "logprob_start_len": EDGE_INT, "top_logprobs_num": EDGE_INT,
        "stream": st.booleans(), "rid": TEXT | st.lists(TEXT, max_size=3), "cache_salt": TEXT | st.none(),
    },
    "/v1/completions": OPENAI_PLAUSIBLE | {
        "prompt": STOPS | st.lists(st.integers(0, 511), max_size=5), "logprobs": EDGE_INT | st.none(),
        "echo": st.booleans(), "best_of": EDGE_INT,
    },
    "/v1/chat/completions": OPENAI_PLAUSIBLE | {
        "messages": MESSAGES, "logprobs": st.booleans(), "top_logprobs": EDGE_INT | st.none(),
        "max_completion_tokens": st.integers(0, 4) | EDGE_INT,
        "chat_template_kwargs": st.dictionaries(TEXT, JUNK, max_size=3),
    },
}  # fmt: skip


@st.composite
def plausible(draw, route: str) -> dict:
    """The route's valid template with a few fields set to typed, edge-of-range values."""
    body = dict(ROUTES[route][0])
    fields = PLAUSIBLE[route]
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=4)):
        body[name] = draw(fields[name])
    if "text" in body and draw(st.booleans()):
        body.pop("input_ids", None)
    return body


def body_bytes(route: str):
    """(bytes, content type): a plausible or mutated request, any JSON value, or bytes."""
    as_json = st.one_of(plausible(route), plausible(route), mutated(route), mutated(route), JUNK)
    as_json = as_json.map(cap_generation)
    encoded = as_json.map(lambda b: json.dumps(b, allow_nan=True).encode())
    raw = st.binary(max_size=300) | st.sampled_from([b"", b"{", b"[" * 5000, b'{"a": NaN}', b"\xff\xfe"])
    return st.tuples(encoded | encoded | encoded | raw, st.sampled_from(CONTENT_TYPES))


def cap_generation(body):
    """Keep requests that may be valid short: at most 4 new tokens. A length field that is
    absent or null would mean the default (128 tokens; the whole context for chat)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if _long(body.get(key)):
            body[key] = 2
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    if "prompt" in body and body.get("max_tokens") is None:
        body["max_tokens"] = 2
    if "model" not in body and "messages" not in body and "prompt" not in body:  # /generate
        sp = body.get("sampling_params")
        if sp is None:
            body["sampling_params"] = {"max_new_tokens": 2}
        for d in sp if isinstance(sp, list) else [sp]:
            if isinstance(d, dict) and (d.get("max_new_tokens") is None or _long(d.get("max_new_tokens"))):
                d["max_new_tokens"] = 2
    return body


def _long(v) -> bool:
    """An integer (or integral float) that would be a long generation within the context."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if isinstance(v, float) and not math.isfinite(v):
        return False
    return 4 < v < 2 * CONTEXT


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:2000]
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["code"] == r.status_code, err
        assert err["param"] is None or isinstance(err["param"], str), err
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for e in events[:-1]:
            err = json.loads(e).get("error")
            assert err is None or err.get("code", 500) < 500, e
    else:
        assert isinstance(r.json(), (dict, list))


@pytest.fixture
def quiet_log(server):
    """Fails the test if the server logged an unexpected exception while it ran."""
    with open(server.log_path, "rb") as f:
        f.seek(0, 2)
        start = f.tell()
    yield
    with open(server.log_path, "rb") as f:
        f.seek(start)
        new = f.read().decode(errors="replace")
    bad = [line for line in new.splitlines() if any(b in line for b in BAD_LOG)]
    assert not bad, "\n".join(bad[:20]) + "\n" + new[-3000:]
    assert server.healthy()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_fuzz_never_5xx(server, quiet_log, route):
    client = httpx.Client(base_url=server.url, timeout=wait(120))

    @FUZZ
    @given(case=body_bytes(route))
    def run(case):
        content, ctype = case
        headers = {"content-type": ctype} if ctype else {}
        check(client.post(route, content=content, headers=headers))
        assert client.get("/health").status_code == 200

    try:
        run()
    finally:
        client.close()


# Each body below once gave a 5xx, or killed the engine loop (every later request hung).
REGRESSIONS = [
    ("/generate", {"text": "a", "sampling_params": {"stop": 5}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": 5}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 10**20, "max_new_tokens": 2}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"seed": 2**70, "max_new_tokens": 2}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"temperature": 10**400, "max_new_tokens": 2}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"skip_special_tokens": "x", "max_new_tokens": 2}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"ignore_eos": [], "max_new_tokens": 2}}, 400),
    ("/generate", {"text": "a", "rid": "", "sampling_params": {"max_new_tokens": 2}}, 400),
    ("/generate", {"text": "a", "cache_salt": "s" * 5000, "sampling_params": {"max_new_tokens": 2}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [[1]] * 5000, "max_tokens": 2}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 10**400}, 400),
    # A template variable named like a Python argument of the renderer: just a variable.
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                              "chat_template_kwargs": {"self": 1}}, 200),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                              "response_format": {"type": []}}, 400),
]  # fmt: skip


@pytest.mark.parametrize("route,body,status", REGRESSIONS)
def test_found_bugs_are_answered(server, quiet_log, route, body, status):
    r = httpx.post(server.url + route, content=json.dumps(body).encode(), timeout=wait(120))
    check(r)
    assert r.status_code == status, r.text


def test_valid_seeds_outside_uint32_still_generate(server, quiet_log):
    """A negative or 64-bit seed is used modulo 2**32 (it once overflowed the batch's seeds
    array and failed every request in the step); seeds that agree modulo 2**32 agree."""
    outs = []
    for seed in (-1, 2**32 - 1, 2**64 - 1):
        sp = {"max_new_tokens": 4, "temperature": 1.0, "seed": seed}
        outs.append(server.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"])
    assert outs[0] == outs[1] == outs[2]


def test_oversized_body_is_413(server, quiet_log):
    from hicache_jax.server.protocol import MAX_BODY_BYTES

    big = b'{"text": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    r = httpx.post(server.url + "/generate", content=big, timeout=wait(120))
    check(r)
    assert r.status_code == 413


@pytest.mark.parametrize(
    "method,path,status",
    [("GET", "/generate", 405), ("PUT", "/v1/completions", 405), ("POST", "/no/such/route", 404)],
)
def test_wrong_method_or_path_is_a_json_4xx(server, quiet_log, method, path, status):
    r = httpx.request(method, server.url + path, content=b"{}", timeout=wait(120))
    check(r)
    assert r.status_code == status


# ---- structured output and function calling (issue 39: each of these once gave a 500) --------
def _nest(schema: dict, depth: int) -> dict:
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


SCHEMA = st.recursive(
    st.booleans()
    | st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(
                ["string", "integer", "number", "boolean", "null", "object", "array", "nope"]
            )
            | JUNK,
            "enum": st.lists(SCALARS, max_size=4) | JUNK,
            "pattern": st.sampled_from(["[a-z]+", "(", "a{5,2}", "\\", ".*"]) | TEXT,
            "minLength": EDGE_INT,
            "maxLength": EDGE_INT,
            "$ref": st.sampled_from(["#", "#/definitions/x", "#/$defs/nope", "http://x/y"]),
            "x-guidance": JUNK,
            "not": st.just({}),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["object", "array"]),
            "properties": st.dictionaries(st.text(max_size=6), inner, max_size=3),
            "items": inner,
            "anyOf": st.lists(inner, max_size=3),
            "allOf": st.lists(inner, max_size=2),
            "definitions": st.dictionaries(st.sampled_from(["x", "y"]), inner, max_size=2),
            "required": st.lists(st.text(max_size=6), max_size=3) | JUNK,
        },
    ),
    max_leaves=10,
)
DEEP_SCHEMA = st.builds(
    _nest, SCHEMA.filter(lambda s: isinstance(s, dict)), st.sampled_from([1, 63, 64, 65, 300])
)
ANY_SCHEMA = SCHEMA | DEEP_SCHEMA
SCHEMA_TEXT = (
    ANY_SCHEMA.map(json.dumps) | st.sampled_from(["false", "true", "5", "null", "{", '{"$ref": "#"}']) | TEXT
)
REGEX = st.sampled_from(["[a-z]{1,3}", "(", "a{5,2}", "", "[^\\x00-\\U0010FFFF]", "(a|b)*c", "\\d+"]) | TEXT
EBNF = st.sampled_from(['root ::= "a"', 'root ::= root "a"', "root ::=", 'root ::= x\nx ::= "b"+']) | TEXT
STRUCTURE = st.fixed_dictionaries(
    {},
    optional={
        "begin": st.sampled_from(["<a>", "<b>"]) | JUNK,
        "end": st.just("</a>") | JUNK,
        "schema": ANY_SCHEMA,
    },
)
STRUCTURAL_TAG = st.fixed_dictionaries(
    {},
    optional={
        "structures": st.lists(STRUCTURE, max_size=2) | JUNK,
        "triggers": st.lists(st.sampled_from(["<a", "<"]), max_size=2) | JUNK,
    },
)
GRAMMAR_PARAMS = st.one_of(
    st.fixed_dictionaries({"json_schema": SCHEMA_TEXT | ANY_SCHEMA | JUNK}),
    st.fixed_dictionaries({"regex": REGEX}),
    st.fixed_dictionaries({"ebnf": EBNF}),
    st.fixed_dictionaries({"structural_tag": STRUCTURAL_TAG.map(json.dumps) | STRUCTURAL_TAG | JUNK}),
    st.fixed_dictionaries({"regex": REGEX, "ebnf": EBNF}),  # two at once
)
FUNCTION = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather", "bad name", ""]) | JUNK},
    optional={"description": TEXT | JUNK, "parameters": ANY_SCHEMA | JUNK, "strict": JUNK},
)
TOOL = st.fixed_dictionaries({"type": st.just("function") | JUNK, "function": FUNCTION | JUNK})
TOOL_CHOICE = st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
    {"type": st.just("function") | JUNK}, optional={"function": st.fixed_dictionaries({"name": JUNK}) | JUNK}
)
CALL = st.fixed_dictionaries(
    {},
    optional={
        "id": TEXT | JUNK,
        "type": st.just("function") | JUNK,
        "function": st.fixed_dictionaries({}, optional={"name": TEXT | JUNK, "arguments": TEXT | JUNK})
        | JUNK,
    },
)
HISTORY = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"])},
        optional={
            "content": TEXT,
            "tool_calls": st.lists(CALL, max_size=2) | JUNK,
            "tool_call_id": TEXT | JUNK,
        },
    ),
    min_size=1,
    max_size=3,
)
RESPONSE_FORMAT = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "structural_tag", "yaml"]) | JUNK},
    optional={
        "json_schema": st.fixed_dictionaries(
            {}, optional={"name": TEXT, "schema": ANY_SCHEMA | JUNK, "strict": JUNK}
        )
        | JUNK,
        "structures": st.lists(STRUCTURE, max_size=2),
        "triggers": st.lists(st.sampled_from(["<a", "<"]), max_size=2),
    },
)


@st.composite
def structured(draw) -> tuple[str, dict]:
    """A request held by a grammar or tools, most of it well-formed, the rest junk."""
    kind = draw(st.sampled_from(["generate", "completions", "chat"]))
    if kind == "generate":
        sp = {"max_new_tokens": 3, **draw(GRAMMAR_PARAMS)}
        return "/generate", {"text": "fuzz", "sampling_params": sp}
    if kind == "completions":
        body = {"model": MODEL, "prompt": "fuzz", "max_tokens": 3}
        body.update(
            draw(st.dictionaries(st.sampled_from(["json_schema", "regex", "ebnf"]), SCHEMA_TEXT, max_size=2))
        )
        return "/v1/completions", body
    body = {"model": MODEL, "max_tokens": 3, "messages": draw(HISTORY | MESSAGES)}
    optional = {
        "tools": st.lists(TOOL, max_size=3) | JUNK,
        "tool_choice": TOOL_CHOICE | JUNK,
        "parallel_tool_calls": st.booleans() | JUNK,
        "response_format": RESPONSE_FORMAT | JUNK,
        "regex": REGEX,
    }
    body.update(draw(st.fixed_dictionaries({}, optional=optional)))
    return "/v1/chat/completions", body


def test_fuzz_structured_output_and_tools_never_5xx(server, quiet_log):
    """Schemas (boolean, deep, self-referencing, unsatisfiable), regexes, EBNF, structural tags,
    response formats, tools, tool_choice and tool_calls history: never a 5xx."""
    client = httpx.Client(base_url=server.url, timeout=wait(120))

    @settings(max_examples=2 * EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=structured())
    def run(case):
        route, body = case
        check(
            client.post(
                route, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
            )
        )

    try:
        run()
        assert client.get("/health").status_code == 200
    finally:
        client.close()
