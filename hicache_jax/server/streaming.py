"""Waiting on engine output from a handler: SSE framing, client disconnects, text deltas.

A client that goes away must not leave its request running (it holds KV pages), streaming
or not. uvicorn never cancels a handler whose client left, so every wait here races the
request's ASGI ``receive`` channel, which yields ``http.disconnect`` when the socket closes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request

from hicache_jax.server.engine_loop import EngineLoop
from hicache_jax.server.errors import ApiError
from hicache_jax.server.messages import Failure, Sink, Update

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class ClientGone(Exception):
    """The client disconnected; its requests were aborted."""


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Watch:
    """The requests behind one HTTP call: yields their events, aborts them all if the client
    leaves or the consumer stops early (``close``)."""

    def __init__(self, loop: EngineLoop, sinks: list[Sink], request: Request):
        self.loop = loop
        self.sinks = sinks
        self._gone = asyncio.ensure_future(_until_disconnected(request))

    async def next(self, sink: Sink) -> Update:
        get = asyncio.ensure_future(sink.queue.get())
        await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            raise ClientGone()
        event = get.result()
        if isinstance(event, Failure):
            sink.done = True
            raise ApiError(500, event.message)
        if event.finished:
            sink.done = True
        return event

    async def updates(self, sink: Sink) -> AsyncIterator[Update]:
        while not sink.done:
            yield await self.next(sink)

    async def finals(self) -> list[dict]:
        """Every request's final output, in order."""
        outs = []
        for sink in self.sinks:
            event = await self.next(sink)
            while not event.finished:  # a streaming request waited on as a whole
                event = await self.next(sink)
            outs.append(event.out)
        return outs

    def close(self) -> None:
        self._gone.cancel()
        for sink in self.sinks:
            if not sink.done:
                self.loop.abort(sink)
                sink.done = True


class TextDelta:
    """Turns cumulative output text into increments for streaming clients.

    Held back until safe: a trailing U+FFFD (a multi-byte character cut between tokens) and
    any tail that could still grow into a stop string (which the final text drops)."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.sent = ""
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stop = stop

    def update(self, text: str | None, finished: bool) -> str:
        text = text or ""
        if not finished:
            for s in self.stop:
                cut = text.find(s)
                if cut >= 0:
                    text = text[:cut]
            text = text.rstrip("\ufffd")
            if self.hold:
                text = text[: max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent):
            return ""  # never take back what a client has; the final text only ever trims
        delta, self.sent = text[len(self.sent) :], text
        return delta
