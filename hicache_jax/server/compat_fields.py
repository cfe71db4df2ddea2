"""Request fields of SGLang's and OpenAI's APIs that this server takes without acting on them.

sglang-router and SGLang clients send SGLang's full request bodies (``/generate``'s
``GenerateReqInput``, the OpenAI routes' SGLang extensions), and OpenAI clients send OpenAI's.
Each field the request models do not implement is listed here, with one of two treatments:

- ``ignored(...)``: every well-typed value is a no-op: logging, metrics, routing hints, and
  options whose every value already describes what this server does;
- ``default_only(...)``: the default (or a listed equivalent) is a no-op; any other value asks
  for something this stack lacks, and is a 400 that names the field and says "not supported".

A field in neither API is still an unknown field: the request models forbid extras.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from hicache_jax.sampling_params import InvalidRequest, SamplingParams, show

_STRICT = ConfigDict(strict=True)


@dataclasses.dataclass(frozen=True)
class Compat:
    name: str
    default: Any
    accepts: tuple | None  # the values that mean the default; None: every value is a no-op
    type: Any = Any  # checked (strictly) for ignored fields only

    def refusal(self, value) -> str | None:
        """Why ``value`` is refused, or None when it is a no-op."""
        if self.accepts is None:
            try:
                TypeAdapter(self.type, config=_STRICT).validate_python(value)
            except ValidationError as e:
                return f"{self.name}: {e.errors()[0]['msg']} (got {show(value)})"
            return None
        if any(same(value, ok) for ok in self.accepts):
            return None
        return (
            f"{self.name}={_json(value)} is not supported by this server "
            f"(leave it out or send {_json(self.default)})"
        )


def ignored(name: str, type_: Any, default: Any = None) -> Compat:
    return Compat(name, default, None, type_)


def default_only(name: str, default: Any = None, *also: Any) -> Compat:
    return Compat(name, default, (default, *also))


def same(value, ref) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(value, bool) or isinstance(ref, bool):
        return value is ref
    if isinstance(value, (int, float)) and isinstance(ref, (int, float)):
        return value == ref
    return type(value) is type(ref) and value == ref


def _json(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return show(value)
    return text if len(text) <= 80 else text[:77] + "..."


def drop_compat(data: Any, fields: tuple[Compat, ...]) -> Any:
    """``data`` (a request body) without ``fields``; a pydantic error naming the first field
    whose value is refused. For a model's ``mode="before"`` validator."""
    if not fields or not isinstance(data, dict):
        return data
    data = dict(data)
    for f in fields:
        if f.name in data:
            why = f.refusal(data.pop(f.name))
            if why:
                raise PydanticCustomError("not_supported", "{message}", {"message": why})
    return data


def sglang_sampling_params(params: Any) -> Any:
    """SGLang ``sampling_params`` without the fields ``SamplingParams`` lacks, when they are at
    their defaults; InvalidRequest ("not supported") when one is not."""
    if not isinstance(params, dict):
        return params
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    params = dict(params)
    for f in SAMPLING:
        if f.name in params and f.name not in known:
            why = f.refusal(params.pop(f.name))
            if why:
                raise InvalidRequest(f"sampling_params.{why}")
    return params


# ---- /generate: SGLang's GenerateReqInput (and what sglang-router adds) ----------------------
GENERATE = (
    ignored("model", str | None),  # sglang-router sends the client's, or "unknown"
    ignored("log_metrics", bool, True),
    ignored("no_logs", bool, False),
    ignored("custom_labels", dict[str, str] | None),
    ignored("conversation_id", str | None),
    ignored("session_id", str | None),  # an identity only; session_params is the feature
    ignored("routing_key", str | None),
    ignored("kv_router_hint", dict | None),
    ignored("external_trace_header", dict | None),
    ignored("received_time", float | None),
    ignored("return_text_in_logprobs", bool, False),  # logprob entries always carry their text
    default_only("input_embeds"),
    default_only("image_data"),
    default_only("video_data"),
    default_only("audio_data"),
    default_only("mm_hashes"),
    default_only("mm_content_hashes"),
    default_only("modalities"),
    default_only("use_audio_in_video", False),
    default_only("video_config"),
    default_only("images_config"),
    default_only("max_dynamic_patch"),
    default_only("min_dynamic_patch"),
    default_only("image_max_dynamic_patch"),
    default_only("video_max_dynamic_patch"),
    default_only("need_wait_for_mm_inputs"),
    default_only("num_items_assigned"),
    default_only("encoder_urls"),
    default_only("positional_embed_overrides"),
    default_only("token_ids_logprob", None, []),
    default_only("return_sampling_mask", None, False),
    default_only("return_flat_raw_top_logprobs", False),
    default_only("return_flat_raw_top_logprobs_b64", False),
    default_only("return_hidden_states", False),
    default_only("return_routed_experts", False),
    default_only("routed_experts_start_len", 0),
    default_only("return_indexer_topk", False),
    default_only("return_prompt_token_ids", False),
    default_only("return_bytes", False),
    default_only("return_entropy", False),
    default_only("session_params"),
    default_only("lora_path"),
    default_only("lora_id"),
    default_only("custom_logit_processor"),
    default_only("bootstrap_pair_key"),
    default_only("decode_tp_size"),
    default_only("routed_dp_rank", None, 0),  # one data-parallel rank: 0
    default_only("data_parallel_rank", None, 0),
    default_only("disagg_prefill_dp_rank"),
    default_only("http_worker_ipc"),
    default_only("background", False),
    default_only("require_reasoning", False),
    default_only("max_thinking_tokens"),
    default_only("priority"),
    default_only("extra_key", None, ""),
    default_only("multi_item_delimiter_indices"),
)

# ---- sampling_params: SGLang's fields (those SamplingParams has are its own to check) ---------
SAMPLING = (
    ignored("stream_interval", int | None),  # how often a stream sends: every step here
    default_only("stop_regex", None, []),
    default_only("spaces_between_special_tokens", True, None),
    default_only("no_stop_trim", False, None),
    default_only("custom_params"),
    default_only("logit_bias", None, {}),
)

# ---- /v1/completions and /v1/chat/completions: SGLang's extensions ----------------------------
OPENAI_COMMON = (
    ignored("session_id", str | None),
    ignored("custom_labels", dict[str, str] | None),
    default_only("return_hidden_states", False),
    default_only("return_routed_experts", False),
    default_only("routed_experts_start_len", 0),
    default_only("return_cached_tokens_details", False),  # details are always in usage here
    default_only("return_token_ids", False),
    default_only("stop_regex", None, []),
    default_only("no_stop_trim", False),
    default_only("lora_path"),
    default_only("session_params"),
    default_only("custom_params"),
    default_only("custom_logit_processor"),
    default_only("images_config"),
    default_only("routed_dp_rank", None, 0),
    default_only("data_parallel_rank", None, 0),
    default_only("disagg_prefill_dp_rank"),
    default_only("rid"),
    default_only("extra_key", None, ""),
    default_only("ngram_corpus_id"),
    default_only("priority"),
)

CHAT = (
    # SGLang's.
    ignored("separate_reasoning", bool, True),  # no reasoning parser: nothing to separate
    ignored("stream_reasoning", bool, True),
    default_only("continue_final_message", False),
    default_only("return_prompt_token_ids", False),
    default_only("return_meta_info", False),
    default_only("reasoning_effort"),
    default_only("reasoning"),
    default_only("task"),
    default_only("input_ids"),
    default_only("max_dynamic_patch"),
    default_only("min_dynamic_patch"),
    default_only("use_audio_in_video", False),
    # OpenAI's.
    ignored("metadata", dict[str, str] | None),
    ignored("prompt_cache_key", str | None),  # a routing hint; the radix cache needs none
    ignored("safety_identifier", str | None),
    ignored("service_tier", str | None),
    default_only("functions"),
    default_only("function_call"),
    default_only("audio"),
    default_only("modalities", None, ["text"]),
    default_only("prediction"),
    default_only("web_search_options"),
    default_only("verbosity"),
    default_only("store", None, False),
)
