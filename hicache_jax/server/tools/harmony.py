"""gpt-oss (harmony): the output is a run of messages, each a header, ``<|message|>``, a body
and an end token (wrapped here)::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
        {"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>Hello<|return|>

The recipient may also stand before the channel (``assistant to=functions.x<|channel|>...``),
so the header is searched for ``to=`` and ``<|channel|>`` wherever they are. A message to
``functions.NAME`` is a call (its body the arguments; a body that is no JSON object is
content instead); the ``final`` channel is the content,
streamed as it comes; analysis and other messages are dropped. ``<|call|>`` and
``<|return|>`` are stop tokens, so the last message may end without one.

When the output has neither a final message nor a call (a model that ignores the format, or
text decoded without its special tokens), the content is the whole text without its markers,
so an answer is never lost (an output cut off while thinking gives its thinking, channel name
and all); a stream can only know that at the end, and sends it then.
"""

from __future__ import annotations

import enum
import re

from hicache_jax.server.tools.calls import Piece, args_call, loads

MARKER = re.compile(r"<\|[a-z0-9_]+\|>")
# The start of a marker at the very end of the text: held back until the next delta.
_PARTIAL = re.compile(r"<(?:\|(?:[a-z0-9_]+\|?)?)?\Z")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_FUNCTIONS = "functions."


class _Body(enum.Enum):
    FINAL = enum.auto()  # content
    CALL = enum.auto()  # arguments, collected until the message ends
    OTHER = enum.auto()  # analysis, preambles, built-in tools: dropped


class HarmonySplitter:
    def __init__(self):
        self._text = ""  # the whole output, for the fallback
        self._pending = ""  # not scanned yet: a possible marker start
        self._header = ""
        self._body: _Body | None = None  # None: in a header
        self._name = ""
        self._args = ""
        self._answered = False  # a final message or a function call was seen

    def feed(self, delta: str) -> list[Piece]:
        self._text += delta
        self._pending += delta
        return self._scan(final=False)

    def close(self) -> list[Piece]:
        out = self._scan(final=True)
        if self._body is not None:
            self._end_message(out)
        if not self._answered:
            out.append(MARKER.sub("", self._text))
        return out

    def _scan(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        text, pos = self._pending, 0
        for m in MARKER.finditer(text):
            self._add_text(text[pos : m.start()], out)
            self._add_marker(m.group(), out)
            pos = m.end()
        partial = None if final else _PARTIAL.search(text, pos)
        cut = partial.start() if partial else len(text)
        self._add_text(text[pos:cut], out)
        self._pending = text[cut:]
        return out

    def _add_text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._body is None:
            self._header += text
        elif self._body is _Body.FINAL:
            out.append(text)
        elif self._body is _Body.CALL:
            self._args += text

    def _add_marker(self, marker: str, out: list[Piece]) -> None:
        if self._body is not None:  # any marker ends a body; <|channel|> opens the next header
            self._end_message(out)
            self._header = marker if marker == "<|channel|>" else ""
        elif marker == "<|message|>":
            self._start_body()
        elif marker in ("<|start|>", "<|end|>", "<|call|>", "<|return|>"):
            self._header = ""  # a header without a body: nothing to keep
        else:
            self._header += marker  # <|channel|>, <|constrain|>

    def _start_body(self) -> None:
        recipient = _RECIPIENT.search(self._header)
        channel = _CHANNEL.search(self._header)
        self._header = ""
        if recipient and recipient.group(1).startswith(_FUNCTIONS) and recipient.group(1) != _FUNCTIONS:
            self._body, self._name, self._args = _Body.CALL, recipient.group(1)[len(_FUNCTIONS) :], ""
            self._answered = True
        elif channel and channel.group(1) == "final":
            self._body = _Body.FINAL
            self._answered = True
        else:
            self._body = _Body.OTHER

    def _end_message(self, out: list[Piece]) -> None:
        if self._body is _Body.CALL:
            call = args_call(self._name, loads(self._args))
            out.append(call if call else self._args)  # arguments that are no JSON object: text
        self._body = None


def splitter() -> HarmonySplitter:
    return HarmonySplitter()
