"""Generated text -> content and OpenAI tool calls, whole (``parse``) or as it streams
(``StreamParser``).

Both run the same per-format splitter, ``parse`` simply feeding it the whole text at once,
so a stream and a one-shot parse of the same output cannot disagree, however the text was cut
into deltas. Output that looks like a call but is not one (bad JSON, no name) stays content:
a model's output never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hicache_jax.server.tools import harmony, hermes, llama3, mistral
from hicache_jax.server.tools.calls import Piece, ToolCall
from hicache_jax.server.tools.formats import ToolFormat

__all__ = ["CallDelta", "ContentDelta", "Event", "Parsed", "StreamParser", "ToolCall", "parse"]


@dataclass(frozen=True)
class Parsed:
    """``content``: the text outside the calls, without surrounding whitespace ("" if none)."""

    content: str
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """A whole call: calls are sent once complete, never as partial arguments, so a client
    never sees arguments that later turn out not to be a call. ``index`` counts from 0."""

    index: int
    name: str
    arguments: str


Event = ContentDelta | CallDelta


class _Splitter(Protocol):
    def feed(self, delta: str) -> list[Piece]: ...

    def close(self) -> list[Piece]: ...


_SPLITTERS: dict[ToolFormat, Callable[[], _Splitter]] = {
    ToolFormat.LLAMA3_JSON: llama3.splitter,
    ToolFormat.MISTRAL: mistral.splitter,
    ToolFormat.HERMES: hermes.splitter,
    ToolFormat.HARMONY: harmony.splitter,
}


class StreamParser:
    """One output's deltas -> events. Content is sent as soon as it cannot be part of a call;
    whitespace at its start and end is dropped, as ``parse`` strips it (whitespace between
    pieces of content waits for the next piece)."""

    def __init__(self, fmt: ToolFormat):
        self.format = ToolFormat(fmt)
        self._splitter = _SPLITTERS[self.format]()
        self._calls = 0
        self._started = False  # some non-whitespace content was sent
        self._space = ""  # whitespace after the content sent so far, held back
        self._closed = False

    def feed(self, delta: str) -> list[Event]:
        if self._closed:
            raise RuntimeError("StreamParser.feed after close")
        return self._events(self._splitter.feed(delta))

    def close(self) -> list[Event]:
        """The output has ended: whatever was held back is decided and sent."""
        if self._closed:
            return []
        self._closed = True
        return self._events(self._splitter.close())

    def _events(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                events.append(CallDelta(self._calls, piece.name, piece.arguments))
                self._calls += 1
                continue
            text = self._trim(piece)
            if not text:
                continue
            if events and isinstance(events[-1], ContentDelta):
                events[-1] = ContentDelta(events[-1].text + text)
            else:
                events.append(ContentDelta(text))
        return events

    def _trim(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        return body


def parse(fmt: ToolFormat, text: str) -> Parsed:
    """The whole output at once."""
    stream = StreamParser(fmt)
    events = stream.feed(text) + stream.close()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = tuple(ToolCall(e.name, e.arguments) for e in events if isinstance(e, CallDelta))
    return Parsed(content=content, calls=calls)
