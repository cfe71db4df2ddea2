"""The calls in the output of ``tool_choice: "required"`` and a named function, whole or cut
short (by ``max_tokens`` or a stop string).

The grammar holds the output to one JSON shape, so the calls are read from it directly:

- named: the function's arguments object; cut short, the text so far is the arguments;
- required: ``[{"name": ..., "parameters": {...}}, ...]``; cut short, every call whose name
  is whole and whose ``"parameters"`` value has begun, the last with the text so far as its
  arguments. A call cut before that has no arguments to report and is left out.

This is what vLLM reports (``vllm/entrypoints/openai/chat_completion/serving.py``): a named
call carries the text as it is; a ``required`` call is reported once its name and the start
of its parameters are there (vLLM streams those; whole, it cannot parse a cut array).
Complete arguments are re-serialized (``calls.dumps``), as vLLM does for ``required``.
"""

from __future__ import annotations

import json

from hicache_jax.server.tools.calls import ToolCall, dumps, loads, skip_space

_DECODER = json.JSONDecoder()


def named_call(name: str, text: str) -> ToolCall:
    args = loads(text)
    return ToolCall(name=name, arguments=text if args is None else dumps(args))


def required_calls(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    pos = skip_space(text, 0)
    if not text.startswith("[", pos):
        return calls
    pos += 1
    while True:  # one call object per turn
        pos = skip_space(text, pos)
        if not text.startswith("{", pos):
            return calls  # "]", or cut before the next call
        call, pos = _call(text, pos + 1)
        if call is not None:
            calls.append(call)
        if pos is None:
            return calls
        pos = skip_space(text, pos)
        if not text.startswith(",", pos):
            return calls
        pos += 1


def _call(text: str, pos: int) -> tuple[ToolCall | None, int | None]:
    """The call whose members start at ``pos``, and the index after its object (None: the
    text ends first; the call still counts if its parameters have begun)."""
    name = args = None
    while True:  # one member per turn
        key, pos = _value(text, skip_space(text, pos))
        if pos is None:
            break
        pos = skip_space(text, pos)
        if not text.startswith(":", pos):
            pos = None
            break
        start = skip_space(text, pos + 1)
        value, pos = _value(text, start)
        if key == "name" and isinstance(value, str):
            name = value
        elif key == "parameters":
            args = dumps(value) if pos is not None else text[start:] or None
        if pos is None:
            break
        pos = skip_space(text, pos)
        if text.startswith("}", pos):
            pos += 1
            break
        if not text.startswith(",", pos):
            pos = None
            break
        pos += 1
    return (ToolCall(name, args) if name is not None and args is not None else None), pos


def _value(text: str, pos: int):
    """The JSON value at ``pos`` and the index after it; ``(None, None)`` when it is cut."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None, None
