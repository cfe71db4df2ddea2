"""Waiting on engine output from a handler: SSE framing, client disconnects, SGLang's
cumulative stream built from deltas.

A client that goes away must not leave its request running (it holds KV pages), streaming
or not. uvicorn never cancels a handler whose client left, so every wait here races the
request's ASGI ``receive`` channel, which yields ``http.disconnect`` when the socket closes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from hicache_jax.engine.outputs import OutputDelta
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
        return _taken(sink, get.result())

    async def updates(self, sink: Sink) -> AsyncIterator[Update]:
        while not sink.done:
            yield await self.next(sink)

    async def interleaved(self) -> AsyncIterator[tuple[int, Update]]:
        """Every request's updates as they arrive, each with the request's index (the
        choices of an ``n > 1`` request stream side by side); ends when all have finished."""
        gets: dict[asyncio.Future, int] = {}

        def wait_on(i: int) -> None:
            gets[asyncio.ensure_future(self.sinks[i].queue.get())] = i

        for i, sink in enumerate(self.sinks):
            if not sink.done:
                wait_on(i)
        try:
            while gets:
                await asyncio.wait({*gets, self._gone}, return_when=asyncio.FIRST_COMPLETED)
                if self._gone.done():
                    raise ClientGone()
                ready = sorted(((i, f) for f, i in gets.items() if f.done()), key=lambda x: x[0])
                for i, f in ready:
                    del gets[f]
                    event = _taken(self.sinks[i], f.result())
                    if not self.sinks[i].done:
                        wait_on(i)
                    yield i, event
        finally:
            for f in gets:
                f.cancel()

    async def finals(self) -> list[dict]:
        """Every request's final output, in order."""
        outs = []
        for sink in self.sinks:
            event = await self.next(sink)
            out = event.out
            while not event.finished:  # a streaming request waited on as a whole: join its deltas
                event = await self.next(sink)
                out.extend(event.out)
            outs.append(out.as_dict() if isinstance(out, OutputDelta) else out)
        return outs

    def close(self) -> None:
        self._gone.cancel()
        for sink in self.sinks:
            if not sink.done:
                self.loop.abort(sink)
                sink.done = True


def _taken(sink: Sink, event: Update | Failure) -> Update:
    """The event a sink gave, marking the sink done after its last; a Failure raises."""
    if isinstance(event, Failure):
        sink.done = True
        raise ApiError(500, event.message)
    if event.finished:
        sink.done = True
    return event


async def wait_whole(watch: Watch) -> list[dict] | None:
    """Every request's final output, or None when the client left first (its requests are
    then aborted). The watch is closed either way."""
    try:
        return await watch.finals()
    except ClientGone:
        return None
    finally:
        watch.close()


def stream_response(watch: Watch, chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """An SSE response: ``chunks``, then ``[DONE]``. Its headers are sent by the time an
    ApiError comes, so that is reported in-band (as OpenAI does); a client that left ends
    it. The watch is closed either way."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except ApiError as e:
            yield sse({"error": {"message": e.message, "type": "server_error", "code": e.status}})
        except ClientGone:
            return
        finally:
            watch.close()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


class CumulativeStream:
    """SGLang's ``/generate`` stream, where every event carries the output so far (text,
    ``output_ids``, logprobs), built from deltas.

    The event grows with the output, but only its bytes are copied again: each part is kept
    JSON-encoded and only the delta is encoded (JSON escapes each character on its own, so
    encoded pieces concatenate), so an event never re-encodes or re-decodes the output.
    ``index``: the choice's position among an ``n > 1`` request's outputs, sent in every
    event as SGLang does (None: a single output, no index)."""

    def __init__(self, index: int | None = None) -> None:
        self._head = b'data: {"text": ' if index is None else b'data: {"index": %d, "text": ' % index
        self._text: bytearray | None = bytearray()
        self._ids = _JsonList()
        self._logprobs: _JsonList | None = None
        self._tops: _JsonList | None = None
        self._fixed = b""  # meta entries sent once and then repeated (input logprobs)

    def event(self, delta: OutputDelta) -> bytes:
        """The SSE event for the output up to and including ``delta``."""
        if delta.pieces is None:
            self._text = None
        elif self._text is not None:
            for piece in delta.pieces:
                self._text += _encode(piece)[1:-1]
        self._ids.extend(delta.output_ids)
        if delta.logprobs is not None:
            self._logprobs = self._logprobs or _JsonList()
            self._logprobs.extend(delta.logprobs)
        if delta.top_logprobs is not None:
            self._tops = self._tops or _JsonList()
            self._tops.extend(delta.top_logprobs)
        meta = dict(delta.meta)
        fixed = {k: meta.pop(k) for k in INPUT_LOGPROB_KEYS if k in meta}
        if fixed:
            self._fixed = b", " + _encode(fixed)[1:-1]
        text = [b"null"] if self._text is None else [b'"', self._text, b'"']
        parts = [self._head, *text, b', "output_ids": ', *self._ids.parts()]
        parts += [b', "meta_info": ', _encode(meta)[:-1]]
        for key, value in (("output_token_logprobs", self._logprobs), ("output_top_logprobs", self._tops)):
            if value is not None:
                parts += [b', "', key.encode(), b'": ', *value.parts()]
        parts += [self._fixed, b"}}\n\n"]
        return b"".join(parts)  # the one copy of the output's bytes


INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs")


def _encode(value) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


class _JsonList:
    """A JSON array that only grows, kept encoded."""

    def __init__(self) -> None:
        self._body = bytearray()

    def extend(self, items: list) -> None:
        if items:
            if self._body:
                self._body += b", "
            self._body += _encode(items)[1:-1]

    def parts(self) -> tuple[bytes, bytearray, bytes]:
        return b"[", self._body, b"]"
