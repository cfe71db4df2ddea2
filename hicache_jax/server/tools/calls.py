"""What every tool-call format shares: the call itself, checking a call's JSON, and small
text helpers for scanning an output that is still growing."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One OpenAI tool call. ``arguments`` is a JSON object as a string, the way the OpenAI API
    carries it (``json.dumps(obj, ensure_ascii=False)``), whatever spacing the model used."""

    name: str
    arguments: str


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads(text: str):
    """Strict JSON: Python's decoder also takes NaN and Infinity, which a client's decoder would
    not. Returns None for anything that is not JSON (a model's output never raises)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        return None


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def to_call(obj, args_required: bool = False) -> ToolCall | None:
    """``{"name": str, "arguments" | "parameters": {...}}`` -> a call, else None. Arguments may
    also come as a JSON string holding an object (some models write them so). Without
    arguments a call takes none, unless ``args_required``: for formats whose calls are bare
    JSON, where a plain JSON answer with a "name" key must stay an answer."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if key not in obj and args_required:
        return None
    return args_call(name, obj.get(key, {}))


def args_call(name: str, args) -> ToolCall | None:
    """A call from a name and its decoded arguments, which must be an object (or a string
    holding one)."""
    if isinstance(args, str):
        args = loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=dumps(args))


_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after ``pos`` (or the end)."""
    return _SPACE.match(text, pos).end()


def partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``: a stream
    holds those back, since the next delta may complete the marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# What a format's splitter hands on, in output order: text that is content, or a call.
Piece = str | ToolCall
