"""Mistral: after the ``[TOOL_CALLS]`` token, either a JSON array of ``{"name", "arguments"}``
(the v3 tokenizers; a single object is taken too) or, from v11 on, ``name[ARGS]{...}`` with
one ``[TOOL_CALLS]`` per call (v13 adds ``[CALL_ID]id`` before ``[ARGS]``; the id is the
model's own and the server makes its own ids, so it is dropped). Content is the text before
the marker. The markers are special tokens: the text must be decoded with them kept.
"""

from __future__ import annotations

import re

from hicache_jax.server.tools.calls import Piece, args_call, loads, skip_space, to_call
from hicache_jax.server.tools.json_span import JsonSpan
from hicache_jax.server.tools.marked import MarkedSplitter

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]+")
_ID = re.compile(r"[\w\-]*")


def _undecided(text: str, final: bool) -> tuple[list[Piece], int] | None:
    """Wait for more, or, once the output has ended, give the unfinished call back as text."""
    return ([MARKER + text], len(text)) if final else None


def _no_call(text: str, used: int) -> tuple[list[Piece], int]:
    return [MARKER + text[:used]], used


def read_call(text: str, final: bool, span: JsonSpan) -> tuple[list[Piece], int] | None:
    """The text after ``[TOOL_CALLS]``: see ``marked`` for the contract."""
    pos = skip_space(text, 0)
    if pos == len(text):
        return _undecided(text, final)
    if text[pos] in "[{":  # v3: a JSON array of calls (or one call)
        end = span.end(text, pos)
        if end is None:
            return _undecided(text, final)
        value = loads(text[pos:end])
        calls = [to_call(item) for item in (value if isinstance(value, list) else [value])]
        if calls and all(calls):
            return calls, end
        return _no_call(text, end)
    name = _NAME.match(text, pos)
    if name is None:
        return _no_call(text, pos)
    pos = name.end()
    tags = (ARGS, CALL_ID)
    if text.startswith(CALL_ID, pos):
        pos = _ID.match(text, pos + len(CALL_ID)).end()
        tags = (ARGS,)
    if not text.startswith(ARGS, pos):
        rest = text[pos:]  # empty while the name or id may go on
        if any(tag.startswith(rest) for tag in tags):
            return _undecided(text, final)
        return _no_call(text, pos)
    pos = skip_space(text, pos + len(ARGS))
    if pos == len(text):
        return _undecided(text, final)
    if text[pos] != "{":
        return _no_call(text, pos)
    end = span.end(text, pos)
    if end is None:
        return _undecided(text, final)
    call = args_call(name.group(), loads(text[pos:end]))
    return ([call], end) if call else _no_call(text, end)


def splitter() -> MarkedSplitter:
    return MarkedSplitter(MARKER, read_call)
