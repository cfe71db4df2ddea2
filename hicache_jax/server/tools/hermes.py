"""Hermes and Qwen 2.5 / 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
blocks anywhere in the output, content around them.

The block ends where its JSON object ends (brackets inside strings do not count), not at the
first ``</tool_call>``: an argument may well contain that text. A model that stops before
``</tool_call>`` (a stop string, the token budget) still made its call if the JSON is whole.
"""

from __future__ import annotations

from hicache_jax.server.tools.calls import Piece, loads, skip_space, to_call
from hicache_jax.server.tools.json_span import JsonSpan
from hicache_jax.server.tools.marked import MarkedSplitter

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def read_call(text: str, final: bool, span: JsonSpan) -> tuple[list[Piece], int] | None:
    """A block's body (the text after ``<tool_call>``): see ``marked`` for the contract. What
    is no call goes back as content, the marker included, so no output is lost."""
    start = skip_space(text, 0)
    if start == len(text):
        return ([OPEN + text], len(text)) if final else None
    if text[start] != "{":
        return [OPEN + text[:start]], start
    end = span.end(text, start)
    if end is None:
        return ([OPEN + text], len(text)) if final else None
    after = skip_space(text, end)
    rest = text[after:]
    if rest.startswith(CLOSE):
        used = after + len(CLOSE)
    elif CLOSE.startswith(rest):  # nothing, or part of the closing tag, so far
        if not final:
            return None
        used = len(text)  # cut off before (or inside) </tool_call>
    else:
        return [OPEN + text[:end]], end  # something else after the JSON: no call
    call = to_call(loads(text[start:end]))
    return ([call], used) if call else ([OPEN + text[:used]], used)


def splitter() -> MarkedSplitter:
    return MarkedSplitter(OPEN, read_call)
