"""Llama 3.1-3.3 JSON tool calls: the whole output is (after an optional ``<|python_tag|>``)
one or more ``{"name": ..., "parameters": {...}}`` objects, several joined by ``;`` (as
vLLM's ``llama3_json`` parser reads them); anything else is content.

There is no marker in front of a bare JSON call, so an output that starts with ``{`` is held
back whole until it ends: only then is it known to be calls rather than a JSON answer.
Everything else streams at once. A call must carry its arguments key, so that a JSON answer
that happens to have a "name" field stays an answer.
"""

from __future__ import annotations

import enum

from hicache_jax.server.tools.calls import Piece, ToolCall, loads, skip_space, to_call
from hicache_jax.server.tools.json_span import json_end

TAG = "<|python_tag|>"


def read_calls(text: str) -> list[ToolCall] | None:
    """The calls the whole of ``text`` is, or None if it is not only calls."""
    pos = skip_space(text, 0)
    if text.startswith(TAG, pos):
        pos += len(TAG)
    calls: list[ToolCall] = []
    while True:
        pos = skip_space(text, pos)
        if pos == len(text) and calls:
            return calls  # a trailing ";"
        if pos == len(text) or text[pos] != "{":
            return None
        end = json_end(text, pos)
        call = None if end is None else to_call(loads(text[pos:end]), args_required=True)
        if call is None:
            return None
        calls.append(call)
        pos = skip_space(text, end)
        if pos == len(text):
            return calls
        if text[pos] != ";":
            return None
        pos += 1


class _Mode(enum.Enum):
    UNDECIDED = enum.auto()  # only whitespace or part of <|python_tag|> so far
    CONTENT = enum.auto()
    CALLS = enum.auto()  # looks like calls: held until the output ends


class Llama3Splitter:
    def __init__(self):
        self._buf = ""
        self._mode = _Mode.UNDECIDED

    def feed(self, delta: str) -> list[Piece]:
        if self._mode is _Mode.CONTENT:
            return [delta] if delta else []
        self._buf += delta
        if self._mode is _Mode.UNDECIDED:
            head = self._buf.lstrip()
            if head.startswith(("{", TAG)):
                self._mode = _Mode.CALLS
            elif head and not TAG.startswith(head):
                self._mode = _Mode.CONTENT
                text, self._buf = self._buf, ""
                return [text]
        return []

    def close(self) -> list[Piece]:
        text, self._buf = self._buf, ""
        calls = read_calls(text) if self._mode is _Mode.CALLS else None
        if calls:
            return list(calls)
        return [text] if text else []


def splitter() -> Llama3Splitter:
    return Llama3Splitter()
