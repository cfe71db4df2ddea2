"""SGLang's request surface: every field of ``/generate``'s ``GenerateReqInput`` (and what
sglang-router adds) and of SGLang's ``CompletionRequest``/``ChatCompletionRequest`` is
accepted at its default with the same output as without it; a value asking for what this
stack lacks is a 400 naming the field and saying "not supported"; a field in neither SGLang
nor OpenAI is still unknown. Also the routes sglang-router probes (/server_info, /model_info,
/v1/models/{id}).

The field lists below are SGLang's, written down from its source (``io_struct.py``,
``entrypoints/openai/protocol.py``, sgl-model-gateway's ``GenerateRequest``) independently of
``hicache_jax/server/compat_fields.py``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hicache_jax.sampling_params import InvalidRequest
from hicache_jax.server import compat_fields
from hicache_jax.server.compat_fields import Compat, same
from hicache_jax.server.errors import describe_validation_errors
from hicache_jax.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from hicache_jax.server.protocol import GenerateRequest

MODEL = "tiny"
GREEDY = {"max_new_tokens": 3, "temperature": 0}

# ---- SGLang's fields and defaults ----------------------------------------------------------------
GENERATE_DEFAULTS = {
    "rid": None, "session_id": None, "input_embeds": None, "image_data": None,
    "video_data": None, "audio_data": None, "mm_hashes": None, "mm_content_hashes": None,
    "use_audio_in_video": False, "video_config": None, "sampling_params": None,
    "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
    "token_ids_logprob": None, "return_sampling_mask": None, "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "stream": False, "log_metrics": True, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_indexer_topk": False,
    "modalities": None, "session_params": None, "lora_path": None, "lora_id": None,
    "custom_logit_processor": None, "positional_embed_overrides": None, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None, "kv_router_hint": None, "routing_key": None,
    "conversation_id": None, "http_worker_ipc": None, "background": False,
    "require_reasoning": False, "max_thinking_tokens": None, "priority": None, "extra_key": None,
    "no_logs": False, "custom_labels": None, "return_bytes": False, "return_entropy": False,
    "return_prompt_token_ids": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "multi_item_delimiter_indices": None,
    "cache_salt": None,
    "model": "unknown",  # sglang-router's GenerateRequest
}  # fmt: skip
SAMPLING_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None,
    "sampling_seed": None,
}  # fmt: skip
_SGLANG_OPENAI = {
    "frequency_penalty": 0.0, "logit_bias": None, "n": 1, "presence_penalty": 0.0, "seed": None,
    "stop": None, "stream": False, "stream_options": None, "user": None,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_cached_tokens_details": False, "return_token_ids": False, "min_tokens": 0,
    "regex": None, "ebnf": None, "stop_token_ids": None, "stop_regex": None,
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "lora_path": None,
    "session_id": None, "session_params": None, "response_format": None, "custom_params": None,
    "custom_logit_processor": None, "images_config": None, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "routed_dp_rank": None,
    "disagg_prefill_dp_rank": None, "data_parallel_rank": None, "rid": None, "extra_key": None,
    "cache_salt": None, "ngram_corpus_id": None, "priority": None,
}  # fmt: skip
COMPLETION_DEFAULTS = {
    **_SGLANG_OPENAI, "best_of": None, "echo": False, "logprobs": None, "max_tokens": 16,
    "suffix": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "json_schema": None, "repetition_penalty": 1.0, "custom_labels": None,
}  # fmt: skip
CHAT_DEFAULTS = {
    **_SGLANG_OPENAI, "logprobs": False, "top_logprobs": None, "max_tokens": None,
    "max_completion_tokens": None, "temperature": None, "top_p": None, "tools": None,
    "tool_choice": "auto", "parallel_tool_calls": True, "return_prompt_token_ids": False,
    "return_meta_info": False, "reasoning_effort": None, "task": None, "top_k": None,
    "min_p": None, "repetition_penalty": None, "continue_final_message": False,
    "separate_reasoning": True, "stream_reasoning": True, "chat_template_kwargs": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "use_audio_in_video": False,
    "input_ids": None,
    # OpenAI's own.
    "audio": None, "function_call": None, "functions": None, "metadata": None,
    "modalities": None, "prediction": None, "prompt_cache_key": None, "safety_identifier": None,
    "service_tier": None, "store": None, "verbosity": None, "web_search_options": None,
}  # fmt: skip

# (path, the request model, a greedy base body, SGLang's defaults, the output of a response)
ROUTES = {
    "generate": (
        "/generate",
        GenerateRequest,
        {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY},
        GENERATE_DEFAULTS,
        lambda r: r["output_ids"],
    ),
    "completions": (
        "/v1/completions",
        CompletionRequest,
        {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0},
        COMPLETION_DEFAULTS,
        lambda r: r["choices"][0]["text"],
    ),
    "chat": (
        "/v1/chat/completions",
        ChatCompletionRequest,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0},
        CHAT_DEFAULTS,
        lambda r: r["choices"][0]["message"]["content"],
    ),
}
ROUTE_NAMES = sorted(ROUTES)


def _with_defaults(route: str, names=None) -> dict:
    _, _, base, defaults, _ = ROUTES[route]
    names = defaults if names is None else names
    return dict(base, **{k: defaults[k] for k in names if k not in base})


def _refusal(model, body: dict) -> str | None:
    """The server's 400 message for ``body``, or None when it parses."""
    try:
        model.model_validate_json(json.dumps(body))
    except ValidationError as e:
        return describe_validation_errors(e.errors())
    return None


# ---- over HTTP on the shared tiny server ---------------------------------------------------------
@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_every_sglang_field_at_its_default_is_a_no_op(server, route):
    path, _, base, _, output = ROUTES[route]
    plain = server.client.post(path, json=base)
    assert plain.status_code == 200, plain.text
    r = server.client.post(path, json=_with_defaults(route))
    assert r.status_code == 200, r.text
    assert output(r.json()) == output(plain.json())


def _json_of(tp) -> st.SearchStrategy:
    """JSON values of an ignored field's type."""
    text = st.text(max_size=12)
    return {
        bool: st.booleans(),
        str | None: st.none() | text,
        float | None: st.none() | st.integers(0, 2**40) | st.floats(allow_nan=False, allow_infinity=False),
        int | None: st.none() | st.integers(-(2**31), 2**31),
        dict[str, str] | None: st.none() | st.dictionaries(text, text, max_size=3),
        dict | None: st.none() | st.dictionaries(text, st.integers() | text, max_size=3),
        bool | None: st.none() | st.booleans(),
    }[tp]


def _no_op_value(f: Compat) -> st.SearchStrategy:
    return _json_of(f.type) if f.accepts is None else st.sampled_from(f.accepts)


@st.composite
def no_op_bodies(draw, route: str) -> dict:
    """The route's base body with some compat fields, each at a value that is a no-op."""
    _, model, base, _, _ = ROUTES[route]
    fields = draw(st.lists(st.sampled_from(model.compat), max_size=8, unique_by=lambda f: f.name))
    return dict(base, **{f.name: draw(_no_op_value(f)) for f in fields})


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_no_op_values_leave_the_output_alone(server, route):
    path, _, base, _, output = ROUTES[route]
    expected = output(server.client.post(path, json=base).json())

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(no_op_bodies(route))
    def check(body):
        r = server.client.post(path, json=body)
        assert r.status_code == 200, (body, r.text)
        assert output(r.json()) == expected, body

    check()


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/generate", {"text": "a", "return_hidden_states": True}, "return_hidden_states"),
        ("/generate", {"text": "a", "sampling_params": {"stop_regex": "a+"}}, "stop_regex"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "no_stop_trim": True}, "no_stop_trim"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
            "continue_final_message",
        ),
    ],
)
def test_unsupported_value_is_a_400_naming_it(server, path, body, field):
    r = server.client.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field in message and "not supported" in message, message


def test_server_info_has_what_the_router_reads(server):
    info = server.client.get("/server_info").json()
    assert info["served_model_name"] == MODEL
    for key in ("tp_size", "dp_size", "page_size", "max_total_tokens", "max_running_requests"):
        assert isinstance(info[key], int) and info[key] >= 1, key
    assert info["page_size"] == 16 and info["context_length"] > 0
    assert info["is_embedding"] is False and isinstance(info["version"], str)
    assert info["engine_config"]["page_size"] == 16  # the nested view stays
    old = server.client.get("/get_server_info").json()
    assert old.keys() == info.keys()
    model = server.client.get("/model_info").json()
    assert model == server.client.get("/get_model_info").json()
    assert model["is_generation"] is True and model["architectures"] == ["preset:tiny"]


def test_model_by_id(server):
    r = server.client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    r = server.client.get("/v1/models/org/other-model")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["type"] == "not_found_error" and "org/other-model" in error["message"]


# ---- the request models alone --------------------------------------------------------------------
def test_compat_fields_are_distinct_from_the_models_own():
    """A compat field that shadowed a real one would be dropped before the model saw it."""
    for model in (GenerateRequest, CompletionRequest, ChatCompletionRequest):
        names = [f.name for f in model.compat]
        assert len(names) == len(set(names)), model
        assert not set(names) & set(model.model_fields), model


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_every_sglang_field_is_known(route):
    _, model, _, defaults, _ = ROUTES[route]
    known = set(model.model_fields) | {f.name for f in model.compat}
    assert sorted(set(defaults) - known) == []
    assert _refusal(model, _with_defaults(route)) is None


SCALARS = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False)
JSON = st.recursive(
    SCALARS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def unsupported(draw, model) -> tuple[str, object]:
    """A field that only takes its default, and a value that is not."""
    f = draw(st.sampled_from([f for f in model.compat if f.accepts is not None]))
    value = draw(JSON.filter(lambda v: not any(same(v, ok) for ok in f.accepts)))
    return f.name, value


@pytest.mark.parametrize("route", ROUTE_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_other_value_is_refused_by_name(route, data):
    _, model, base, _, _ = ROUTES[route]
    name, value = data.draw(unsupported(model))
    message = _refusal(model, dict(base, **{name: value}))
    assert message is not None and name in message and "not supported" in message, (name, value)


@pytest.mark.parametrize("route", ROUTE_NAMES)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_field_in_neither_api_is_unknown(route, data):
    _, model, base, defaults, _ = ROUTES[route]
    known = set(model.model_fields) | {f.name for f in model.compat} | set(defaults)
    name = data.draw(st.text(min_size=1, max_size=20).filter(lambda n: n not in known))
    message = _refusal(model, dict(base, **{name: data.draw(JSON)}))
    assert message is not None and "unknown field" in message and repr(name) in message


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(sorted(SAMPLING_DEFAULTS)), unique=True, max_size=10).map(
        lambda names: {k: SAMPLING_DEFAULTS[k] for k in names}
    )
)
def test_sglang_sampling_params_at_defaults_are_accepted(params):
    body = {"input_ids": [5, 6], "sampling_params": dict(params, max_new_tokens=2)}
    reqs, _ = GenerateRequest.model_validate_json(json.dumps(body)).to_engine_requests()
    assert reqs[0]["sampling_params"]["max_new_tokens"] == 2


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_sglang_sampling_params_off_default_are_refused_by_name(data):
    f = data.draw(st.sampled_from([f for f in compat_fields.SAMPLING if f.accepts is not None]))
    value = data.draw(JSON.filter(lambda v: not any(same(v, ok) for ok in f.accepts)))
    body = GenerateRequest.model_validate_json(json.dumps({"text": "a", "sampling_params": {f.name: value}}))
    with pytest.raises(InvalidRequest, match=f"sampling_params.{f.name}.*not supported"):
        body.to_engine_requests()


def test_a_field_named_body_is_named_unknown():
    """FastAPI's locations start with ``"body"``; only that entry is dropped (a field named
    ``body`` once read as ``unknown field ''``, found by the test above)."""
    for route in ROUTE_NAMES:
        _, model, base, _, _ = ROUTES[route]
        assert "unknown field 'body'" in _refusal(model, dict(base, body=1))
    error = {"type": "extra_forbidden", "loc": ("body", "body"), "msg": "Extra inputs are not permitted"}
    assert describe_validation_errors([error], under_body=True) == "unknown field 'body'"
