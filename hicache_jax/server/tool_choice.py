"""OpenAI function calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``,
``parallel_tool_calls``, and turning the output back into ``tool_calls``.

- ``tool_choice: "none"``: the tools still reach the chat template (as vLLM and SGLang pass
  them); the output is content, never parsed.
- ``"auto"`` (the default with tools): the model writes calls in its family's own format,
  parsed by ``tools/parsers.py`` (the format: ``--tool_call_parser``, else guessed from the
  chat template). Formats whose markers are special tokens are decoded with them kept.
- ``"required"`` and a named function: the output is held by a JSON-schema grammar
  (``hicache_jax/grammar``), so the call always parses. Named: the function's arguments
  object. Required: an array of ``{"name", "parameters"}`` objects, one of the tools each
  (one call at most when ``parallel_tool_calls`` is false). This is vLLM's scheme: the
  grammar is the same for every family, and a model that was prompted by its template to
  call a tool writes the call's JSON readily. The family's own markers are not forced.

Finish reasons follow OpenAI: ``tool_calls`` when the model called a tool (``auto``,
``required``), ``stop`` for a named function. An output cut short by ``max_tokens`` still
gives the calls it began (``tools/constrained.py``), with ``finish_reason: "length"``, as
vLLM answers a whole response: a client that reads ``tool_calls`` finds them, and the reason
says their arguments may be cut. (vLLM's streamed ``required`` says ``tool_calls`` there.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from hicache_jax.finish import Finish
from hicache_jax.grammar.spec import MAX_GRAMMAR_BYTES, MAX_JSON_DEPTH, json_depth
from hicache_jax.sampling_params import InvalidRequest, show
from hicache_jax.server.tools.constrained import named_call, required_calls
from hicache_jax.server.tools.formats import ToolFormat, needs_special_tokens
from hicache_jax.server.tools.parsers import CallDelta, ContentDelta, StreamParser, ToolCall, parse

NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")
MAX_TOOLS = 128  # OpenAI's limit on a request's tools
MAX_TOOLS_BYTES = MAX_GRAMMAR_BYTES  # their JSON: what a required/named grammar is built from


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict, ...]  # the request's tools (OpenAI's dicts)
    named: str | None = None
    parallel: bool = True
    fmt: ToolFormat | None = None  # how "auto" output is parsed (None: not parsed)

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def sampling_params(self) -> dict:
        """What the mode adds to the request's sampling params."""
        if self.mode == "named":
            return {"json_schema": json.dumps(self._parameters(self.named))}
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": self._parameters(name)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name in self.names
            ]
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return {"json_schema": json.dumps(schema)}
        if self.mode == "auto" and self.fmt is not None and needs_special_tokens(self.fmt):
            return {"skip_special_tokens": False}
        return {}

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def _parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's finish reason for a choice that ended with ``reason``: ``length`` stays
        ``length``, calls or not."""
        if called and reason == Finish.STOP and self.mode != "named":
            return "tool_calls"
        return reason

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole output -> (content, OpenAI ``tool_calls``)."""
        if self.mode == "none" or (self.mode == "auto" and self.fmt is None):
            return text, []
        if self.mode == "auto":
            parsed = parse(self.fmt, text)
            calls = [openai_call(c.name, c.arguments) for c in parsed.calls]
            return (parsed.content or None) if calls else parsed.content, calls
        held = [named_call(self.named, text)] if self.mode == "named" else required_calls(text)
        return None, [openai_call(c.name, c.arguments) for c in held]

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """A streaming choice's deltas: content as it comes, each call once it is whole (for
    ``required`` and named functions: at the end of the output, complete or cut short)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parser = StreamParser(plan.fmt) if plan.mode == "auto" and plan.fmt is not None else None
        self.buffer = "" if plan.constrained else None
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        """OpenAI ``delta`` dicts for the next piece of output text."""
        if self.buffer is not None:
            self.buffer += text
            return []
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self.parser.feed(text))

    def close(self) -> list[dict]:
        if self.buffer is not None:
            content, calls = self.plan.split(self.buffer)
            self.calls = len(calls)
            if not calls:
                return [{"content": content}] if content else []
            return [{"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]}]
        return self._deltas(self.parser.close()) if self.parser is not None else []

    def _deltas(self, events) -> list[dict]:
        out = []
        for e in events:
            if isinstance(e, ContentDelta) and e.text:
                out.append({"content": e.text})
            elif isinstance(e, CallDelta):
                self.calls += 1
                out.append({"tool_calls": [dict(openai_call(e.name, e.arguments), index=e.index)]})
        return out


def openai_call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def plan(tools, tool_choice, parallel, fmt: ToolFormat | None) -> ToolPlan | None:
    """The request's plan (None: no tools, nothing to do); InvalidRequest naming the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequest(f"tool_choice={show(tool_choice)} needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools: {len(tools)} tools; at most {MAX_TOOLS}")
    tools = tuple(_check_tool(i, t) for i, t in enumerate(tools))
    size = len(json.dumps(tools).encode())
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequest(f"tools: {size} bytes of JSON; at most {MAX_TOOLS_BYTES}")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools: function names must be unique, got {names}")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false")
    kw = dict(tools=tools, parallel=parallel is not False, fmt=fmt)
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolPlan(mode=tool_choice or "auto", **kw)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest(f'tool_choice.function must be an object {{"name": ...}}, got {show(fn)}')
        name = fn.get("name")
        if name not in names:
            raise InvalidRequest(f"tool_choice names function {show(name)}, which is not in tools {names}")
        return ToolPlan(mode="named", named=name, **kw)
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
        f"got {show(tool_choice)}"
    )


def _check_tool(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise InvalidRequest(
            f'{where}: must be {{"type": "function", "function": {{...}}}}, got {show(tool)}'
        )
    fn = tool["function"]
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequest(f"{where}.function: unknown field(s) {unknown}")
    if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
        raise InvalidRequest(
            f"{where}.function.name must match [a-zA-Z0-9_.-]{{1,64}}, got {show(fn.get('name'))}"
        )
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object")
    if json_depth(fn.get("parameters") or {}) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"{where}.function.parameters: nested more than {MAX_JSON_DEPTH} levels deep")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise InvalidRequest(f"{where}.function.description must be a string")
    return tool


def check_tool_calls(calls: list, where: str) -> None:
    """An assistant message's ``tool_calls`` (history) in OpenAI's shape, or InvalidRequest
    naming the entry: ``{"id": str, "type": "function", "function": {"name": str,
    "arguments": str | object}}`` (``id`` and ``type`` may be left out)."""
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(c, dict):
            raise InvalidRequest(f"{at} must be an object, got {show(c)}")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise InvalidRequest(f"{at}.id must be a string, got {show(c['id'])}")
        if c.get("type", "function") != "function":
            raise InvalidRequest(f'{at}.type must be "function", got {show(c.get("type"))}')
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                f'{at}.function must be an object {{"name": str, "arguments": ...}}, got {show(fn)}'
            )
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise InvalidRequest(
                f"{at}.function.arguments must be a JSON string or an object, got {show(args)}"
            )


def template_message(m: dict) -> dict:
    """An assistant message's ``tool_calls`` as chat templates read them: arguments as an
    object when they parse (Llama's and Mistral's templates write them with ``tojson``;
    Qwen's takes either), as vLLM renders them."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append({**c, "function": fn})
    return {**m, "tool_calls": out}


__all__ = ["ToolCall", "ToolPlan", "ToolStream", "check_tool_calls", "plan", "template_message"]
