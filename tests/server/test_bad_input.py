"""Every kind of bad input gets a 4xx whose message says what is wrong, and the server
keeps serving; the admin routes too, fuzzed (and /start_profile never writes outside
--profile_dir)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import CONTEXT

OK = {"max_new_tokens": 2, "temperature": 0}
TOO_LONG = [5] * (CONTEXT + 10)
MODEL = "tiny"
CHAT = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, path, raw body or JSON object, status, words the message must contain)
    ("malformed-json", "/generate", '{"text": "a"', 400, "malformed JSON"),
    ("not-an-object", "/generate", "[1, 2]", 400, "JSON object"),
    ("empty-body", "/generate", "", 400, "JSON object"),
    ("unknown-field", "/generate", {"text": "a", "max_new_tokens": 3}, 400, "unknown field 'max_new_tokens'"),
    ("mistyped-field", "/generate", {"text": "a", "return_logprob": "yes"}, 400, "return_logprob"),
    ("mistyped-rid", "/generate", {"text": "a", "rid": 5}, 400, "rid"),
    (
        "mistyped-sampling",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": "4"}},
        400,
        "max_new_tokens",
    ),
    (
        "unknown-sampling",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_token": 4}},
        400,
        "max_new_token",
    ),
    ("sampling-not-object", "/generate", {"text": "a", "sampling_params": 3}, 400, "sampling_params"),
    ("id-over-vocab", "/generate", {"input_ids": [1, 512], "sampling_params": OK}, 400, "vocabulary"),
    ("negative-id", "/generate", {"input_ids": [1, -1], "sampling_params": OK}, 400, "vocabulary"),
    ("float-id", "/generate", {"input_ids": [1, 2.5], "sampling_params": OK}, 400, "integers"),
    ("empty-text", "/generate", {"text": ""}, 400, "empty"),
    ("empty-ids", "/generate", {"input_ids": []}, 400, "input_ids"),
    ("empty-in-batch", "/generate", {"input_ids": [[1, 2], []]}, 400, "input_ids[1] is empty"),
    ("too-long", "/generate", {"input_ids": TOO_LONG, "sampling_params": OK}, 400, "context length"),
    (
        "negative-max-new",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        400,
        "max_new_tokens",
    ),
    (
        "huge-max-new",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 10**9}},
        400,
        "max_new_tokens",
    ),
    (
        "negative-temperature",
        "/generate",
        {"text": "a", "sampling_params": {"temperature": -0.5}},
        400,
        "temperature",
    ),
    (
        "nan-temperature",
        "/generate",
        '{"text": "a", "sampling_params": {"temperature": NaN}}',
        400,
        "temperature",
    ),
    ("top-p-zero", "/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("top-p-over-one", "/generate", {"text": "a", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    ("top-k-zero", "/generate", {"text": "a", "sampling_params": {"top_k": 0}}, 400, "top_k"),
    (
        "text-and-ids",
        "/generate",
        {"text": "a", "input_ids": [1, 2]},
        400,
        "exactly one of text or input_ids",
    ),
    ("neither", "/generate", {"sampling_params": OK}, 400, "exactly one of text or input_ids"),
    (
        "params-count",
        "/generate",
        {"text": ["a", "b"], "sampling_params": [OK]},
        400,
        "1 sampling_params for 2",
    ),
    (
        "bad-logprob-start",
        "/generate",
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 9},
        400,
        "logprob_start_len",
    ),
    ("duplicate-rid", "/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, 400, "distinct"),
    ("stream-batch", "/generate", {"text": ["a", "b"], "stream": True}, 400, "single prompt"),
    # OpenAI routes.
    ("oai-unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "gpt-9"),
    ("oai-missing-prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    (
        "oai-unknown-field",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_new_tokens": 2},
        400,
        "unknown field",
    ),
    (
        "oai-negative-max",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": -1},
        400,
        "max_tokens",
    ),
    ("oai-n", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n must be >= 1"),
    (
        "oai-penalty",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "presence_penalty": 2.5},
        400,
        "presence_penalty: must be in [-2, 2]",
    ),
    (
        "oai-too-long",
        "/v1/completions",
        {"model": MODEL, "prompt": TOO_LONG, "max_tokens": 1},
        400,
        "context length",
    ),
    ("chat-empty", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "chat-bad-role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "role",
    ),
    (
        "chat-bad-temp",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "temperature": -1},
        400,
        "temperature",
    ),
    (
        "chat-top-logprobs",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "top_logprobs": 2},
        400,
        "logprobs",
    ),
    # SGLang's fields: a value this stack cannot honour, or of the wrong type.
    (
        "sglang-hidden-states",
        "/generate",
        {"text": "a", "return_hidden_states": True},
        400,
        "return_hidden_states=true is not supported",
    ),
    ("sglang-lora", "/generate", {"text": "a", "lora_path": "x"}, 400, 'lora_path="x" is not supported'),
    ("sglang-mistyped-no-op", "/generate", {"text": "a", "log_metrics": "yes"}, 400, "log_metrics"),
    (
        "sglang-penalty",
        "/generate",
        {"text": "a", "sampling_params": {"repetition_penalty": 0}},
        400,
        "sampling_params.repetition_penalty: must be in (0, 2]",
    ),
    (
        "oai-min-tokens",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "min_tokens": 20, "max_tokens": 4},
        400,
        "min_new_tokens: must be in [0, max_new_tokens=4]",
    ),
    (
        "oai-stream-options-without-stream",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "chat-tools",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]},
        400,
        "tools[0].function.name",
    ),
    ("oai-unknown-model-card", "/v1/models/gpt-9", None, 404, "gpt-9"),
    # Admin routes.
    ("profile-absolute", "/start_profile", {"output_dir": "/etc/cron.d"}, 400, "outside --profile_dir"),
    ("profile-dotdot", "/start_profile", {"output_dir": "../x"}, 400, "outside --profile_dir"),
    ("profile-mistyped", "/start_profile", {"num_steps": "3"}, 400, "num_steps"),
    ("profile-not-object", "/start_profile", "[1]", 400, "JSON object"),
    ("stop-profile-idle", "/stop_profile", "", 400, "no profile is running"),
]


@pytest.mark.parametrize("path,body,status,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_4xx_with_a_reason(server, path, body, status, words):
    if body is None:
        r = server.client.get(path)
    else:
        raw = body if isinstance(body, str) else json.dumps(body)
        r = server.client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert words in message, message


def test_wrong_method_and_path(server):
    assert server.client.get("/generate").status_code == 405
    assert server.client.post("/nope").status_code == 404


ADMIN = ["/flush_cache", "/pause_generation", "/continue_generation", "/start_profile", "/stop_profile"]
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=8,
)
DIR_NAMES = st.lists(st.sampled_from(["a", "..", ".", "", "/", "tmp", "\x00", "~"]), max_size=5).map("/".join)
PROFILE_BODIES = st.fixed_dictionaries(
    {}, optional={"output_dir": DIR_NAMES | st.text(max_size=20), "num_steps": st.integers(-2, 3)}
)
BODIES = (
    JUNK.map(lambda v: json.dumps(v).encode())
    | PROFILE_BODIES.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=40)
)


def test_admin_routes_fuzzed(server):
    """Whatever the body: never a 5xx, errors in the project's shape, a started profile lies
    under --profile_dir; the server is left unpaused and without a running profile."""
    root = os.path.realpath(server.profile_dir)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(ADMIN), BODIES)
    def check(path, raw):
        r = server.client.post(path, content=raw, headers={"Content-Type": "application/json"})
        try:
            assert r.status_code < 500, (path, raw, r.text)
            if r.status_code >= 400:
                assert isinstance(r.json()["error"]["message"], str)
            elif path == "/start_profile":
                out = r.json()["output_dir"]
                assert out == root or out.startswith(root + os.sep), (raw, out)
        finally:
            server.client.post("/stop_profile")  # 400 when none runs
            server.client.post("/continue_generation")
            for entry in os.listdir(root) if os.path.isdir(root) else []:  # traces count against the quota
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)

    check()
    assert server.client.post("/stop_profile").status_code == 400


def test_server_still_serves_after_bad_input(server):
    assert server.healthy()
    out = server.generate(text="still here", sampling_params=OK)
    assert len(out["output_ids"]) == 2
    assert server.metrics()["hicache_num_running_reqs"] == 0  # no half-admitted request left behind
