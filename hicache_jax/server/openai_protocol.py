"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) and their mapping to
engine sampling settings. Unknown fields are refused; accepted-but-unsupported settings
(``logit_bias``, ``best_of`` other than ``n``, ``echo`` with ``stream``) are refused
with a message saying so rather than silently ignored; ``n > 1`` is served (``choices``),
and so are ``frequency_penalty`` and ``presence_penalty`` (``runtime/penalties.py``).
``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``repetition_penalty``, ``min_tokens`` and ``cache_salt`` are accepted as extensions, as in
SGLang and vLLM;
SGLang's other extensions and OpenAI's other fields are in ``compat_fields``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hicache_jax.sampling_params import MAX_TOP_LOGPROBS, InvalidRequest
from hicache_jax.server import choices, compat_fields, response_format, tool_choice
from hicache_jax.server.protocol import MAX_BATCH, StrictModel


class StreamOptions(StrictModel):
    """OpenAI's, and vLLM's ``continuous_usage_stats`` (usage in every chunk)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(StrictModel):
    compat = compat_fields.OPENAI_COMMON
    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # SGLang's and vLLM's extensions
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    # sglang-router's PD mode (server/disaggregation.py; host and port are not used here).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # Structured output (``hicache_jax/grammar``): OpenAI's, and SGLang's extensions.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    def check_supported(self, max_n: int = 128) -> None:
        for name in ("max_tokens", "max_completion_tokens"):
            limit = getattr(self, name, None)
            if limit is not None and limit < 0:
                raise InvalidRequest(f"{name} must be >= 0, got {limit}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true")
        choices.check_n(self.n, 1, MAX_BATCH, max_n)  # and per prompt count, where the prompts are known
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_new_tokens: int) -> dict:
        """SGLang sampling_params; unset fields keep the engine's (= OpenAI's) defaults."""
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        for name in (
            *("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "skip_special_tokens"),
            *("frequency_penalty", "presence_penalty", "repetition_penalty"),
        ):
            if getattr(self, name) is not None:
                sp[name] = getattr(self, name)
        if self.min_tokens is not None:
            sp["min_new_tokens"] = self.min_tokens
        if self.stop is not None:
            sp["stop"] = list(self.stop_strings())
        if self.stop_token_ids:
            sp["stop_token_ids"] = self.stop_token_ids
        sp.update(self.grammar_params())
        return sp

    def grammar_params(self) -> dict:
        """The output's grammar as SGLang sampling params (at most one source)."""
        sources = {
            "response_format": response_format.grammar_params(self.response_format),
            "regex": {"regex": self.regex} if self.regex is not None else {},
            "ebnf": {"ebnf": self.ebnf} if self.ebnf is not None else {},
            "json_schema": _json_schema(getattr(self, "json_schema", None)),
        }
        given = [name for name, params in sources.items() if params]
        if len(given) > 1:
            raise InvalidRequest(f"{' and '.join(given)} both constrain the output; send one")
        return next((p for p in sources.values() if p), {})

    @property
    def include_usage(self) -> bool:
        """A last chunk with the usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """The usage so far in every chunk."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    compat = compat_fields.OPENAI_COMMON
    prompt: Any  # str | list[str] | list[int] | list[list[int]]
    json_schema: str | dict[str, Any] | None = None  # SGLang's extension
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self, max_n: int = 128) -> None:
        super().check_supported(max_n)
        if self.echo and self.stream:
            raise InvalidRequest("echo with stream=true is not supported; send stream=false")
        if self.suffix:
            raise InvalidRequest("suffix is not supported")
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise InvalidRequest(f"best_of must be >= n ({n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > n:
            raise InvalidRequest(f"best_of={self.best_of} is not supported (only best_of equal to n, {n})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    def prompts(self) -> list[dict]:
        """[{text} | {input_ids}] per prompt."""
        p = self.prompt
        if isinstance(p, str):
            p = [p]
        if not isinstance(p, list) or not p:
            raise InvalidRequest("prompt must be a string, a list of strings or a list of token ids")
        if len(p) > MAX_BATCH and not all(_is_int(x) for x in p):
            raise InvalidRequest(f"at most {MAX_BATCH} prompts per request, got {len(p)}")
        if all(isinstance(x, str) for x in p):
            if not all(p):
                raise InvalidRequest("prompt is empty")
            return [{"text": x} for x in p]
        if all(_is_int(x) for x in p):
            return [{"input_ids": p}]
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            return [{"input_ids": x} for x in p]
        raise InvalidRequest("prompt must be a string, a list of strings or a list of token ids")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call

    def as_template_input(self, where: str = "message") -> dict:
        """The message as the chat template reads it; ``where`` names it in errors."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequest(
                    f"{where}.tool_calls in a {self.role!r} message: only assistant messages make calls"
                )
            tool_choice.check_tool_calls(self.tool_calls, where)
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return tool_choice.template_message(out)


class ChatCompletionRequest(_Common):
    compat = compat_fields.OPENAI_COMMON + compat_fields.CHAT
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None

    def check_supported(self, max_n: int = 128) -> None:
        super().check_supported(max_n)
        if not self.messages:
            raise InvalidRequest("messages is empty")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
        clash = sorted(reserved & set(self.chat_template_kwargs or {}))
        if clash:
            raise InvalidRequest(f"chat_template_kwargs may not set {clash}")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequest("top_logprobs needs logprobs=true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
                )

    def max_new_tokens(self, prompt_len: int, context_len: int) -> int:
        """Explicit limit, else whatever the context leaves (OpenAI's chat default)."""
        for limit in (self.max_completion_tokens, self.max_tokens):
            if limit is not None:
                return limit
        return max(context_len - prompt_len, 0)


def _json_schema(schema) -> dict:
    if schema is None:
        return {}
    return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
