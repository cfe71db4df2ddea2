"""Formats whose calls start at a fixed marker (``<tool_call>``, ``[TOOL_CALLS]``): text up to
the marker is content and streams at once, then the format reads the call that follows.

The format supplies ``read_call(text, final, span)``, given the text just after the marker
and a ``JsonSpan`` kept for this call (the text only grows until the call is decided). It
answers None while the call is undecided (the model is still writing it), or the pieces it
makes (calls, or the raw text as content when it is no call) and how many characters they
used; scanning then goes on after them. ``final`` is True once the output has ended, when it
must decide. Its decisions must not depend on text past the characters it used, and it must
not decide early: that is what makes every split of the output parse alike.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_jax.server.tools.calls import Piece, partial_suffix
from hicache_jax.server.tools.json_span import JsonSpan

ReadCall = Callable[[str, bool, JsonSpan], tuple[list[Piece], int] | None]


class MarkedSplitter:
    """Splits a growing output into content and calls at ``marker``."""

    def __init__(self, marker: str, read_call: ReadCall):
        self._marker = marker
        self._read_call = read_call
        self._buf = ""  # text not yet handed on
        self._in_call = False  # the buffer starts just after a marker
        self._span = JsonSpan()

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        return self._drain(final=False)

    def close(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._in_call:
                step = self._read_call(self._buf, final, self._span)
                if step is None:
                    return out
                pieces, used = step
                out.extend(pieces)
                self._buf = self._buf[used:]
                self._in_call = False
                continue
            at = self._buf.find(self._marker)
            if at >= 0:
                if at:
                    out.append(self._buf[:at])
                self._buf = self._buf[at + len(self._marker) :]
                self._in_call = True
                self._span = JsonSpan()
                continue
            # No marker: all but a possible marker start is content.
            cut = len(self._buf) - (0 if final else partial_suffix(self._buf, self._marker))
            if cut:
                out.append(self._buf[:cut])
                self._buf = self._buf[cut:]
            return out
