"""Where a JSON object or array ends inside generated text, found while the text still grows.

Only the nesting is followed, with brackets inside strings skipped, so an argument such as
``"</tool_call>"`` or ``"}"`` cannot end a call early; whether the span is valid JSON is
``loads``'s question. A stream asks again after every delta, so the scan resumes where it
stopped: a long call streamed in small deltas is read once, not once per delta.
"""

from __future__ import annotations

import re

# The rest of a string after its opening quote, up to (not past) its closing quote, a
# backslash with nothing after it yet, or the end of the text. Possessive: no backtracking.
_STRING_REST = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
_STRUCTURE = re.compile(r'["{}\[\]]')


class JsonSpan:
    """``end(text, start)``: the index just past the bracket that closes the one at
    ``text[start]``, or None while it has not closed. Between calls the text may only grow
    (each call passes the earlier text and more); a different ``start`` starts over."""

    def __init__(self) -> None:
        self._restart(-1)

    def _restart(self, start: int) -> None:
        self._start = start
        self._pos = start  # where scanning resumes
        self._depth = 0
        self._in_string = False
        self._end: int | None = None

    def end(self, text: str, start: int) -> int | None:
        if start != self._start:
            self._restart(start)
        if self._end is not None:
            return self._end
        pos = self._pos
        while True:
            if self._in_string:
                pos = _STRING_REST.match(text, pos).end()
                if pos == len(text) or text[pos] != '"':  # not closed yet
                    self._pos = pos
                    return None
                pos += 1
                self._in_string = False
            token = _STRUCTURE.search(text, pos)
            if token is None:
                self._pos = len(text)
                return None
            pos = token.end()
            char = token.group()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._end = pos
                    return pos


def json_end(text: str, start: int) -> int | None:
    """``JsonSpan.end`` for a text seen once."""
    return JsonSpan().end(text, start)
