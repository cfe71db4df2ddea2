"""The typed messages between the HTTP layer (asyncio) and the engine thread, and the
thread-safe plumbing that carries answers back: ``Reply`` (one answer) and ``Sink`` (a
request's stream of ``Update``/``Failure`` events). Both resolve on the asyncio loop through
``call_soon_threadsafe``, the one asyncio call that is safe from another thread."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from hicache_jax.engine.outputs import OutputDelta


# ---- plumbing back to asyncio ----------------------------------------------------------------
def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed (shutting down): nobody is waiting
        pass


class Reply:
    """A one-shot answer from the engine thread to a waiting coroutine."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future = self._loop.create_future()

    def set(self, value: Any) -> None:  # engine thread
        _call_soon(self._loop, self._resolve, value)

    def _resolve(self, value: Any) -> None:
        if not self._future.done():  # the waiter may have been cancelled
            self._future.set_result(value)

    def __await__(self):
        return self._future.__await__()


@dataclasses.dataclass
class Update:
    """A request's output: a streaming request's ``OutputDelta`` (what is new since its previous
    update), else the whole output dict, once. ``finished`` on the last one."""

    out: dict | OutputDelta
    finished: bool


@dataclasses.dataclass
class Failure:
    """The engine failed while running this request."""

    message: str


def _partial(event) -> bool:
    return isinstance(event, Update) and not event.finished and isinstance(event.out, OutputDelta)


class _Coalescing(asyncio.Queue):
    """A non-final delta joins the one still unread (``OutputDelta.extend``: texts and ids
    concatenated, newest counters), so a slow reader loses nothing and the queue never holds
    more than a few events: a stalled streaming client holds one growing delta, never one
    event per step."""

    def _put(self, item) -> None:  # asyncio.Queue's hook for how items are stored
        if self._queue and _partial(item) and _partial(self._queue[-1]):
            self._queue[-1].out.extend(item.out)
        else:
            self._queue.append(item)


class Sink:
    """Per-request queue of ``Update``/``Failure`` events, fed from the engine thread."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self._loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update | Failure] = _Coalescing()
        self.done = False  # set by the consumer once it saw the final event

    def put(self, event: Update | Failure) -> None:  # engine thread
        _call_soon(self._loop, self.queue.put_nowait, event)


# ---- messages --------------------------------------------------------------------------------
@dataclasses.dataclass
class Generate:
    """Queue one or more requests, all or none. ``reply`` gets None, or the
    ``InvalidRequest`` that refused one of them (then none is queued)."""

    requests: list[dict]  # Engine.add_request keyword arguments, each with its rid
    sinks: list[Sink]
    reply: Reply
    received: float = dataclasses.field(default_factory=time.monotonic)  # queued by the handler


@dataclasses.dataclass
class Abort:
    """Abort ``rid`` if it is still the request that ``sink`` listens to."""

    rid: str
    sink: Sink


@dataclasses.dataclass
class Flush:
    """Wait until no request is running or waiting, then ``engine.flush_cache()``; refused
    (a ``FlushResult`` saying so) if that has not happened by ``deadline`` (monotonic time).
    Requests that arrive meanwhile are admitted as usual: a flush never holds them."""

    reply: Reply
    deadline: float
    received: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class ClearStorage:
    reply: Reply  # gets (ok, message)
    all_namespaces: bool = False  # every model's pages, not only this server's


@dataclasses.dataclass
class GetMetrics:
    reply: Reply  # gets a dict of plain numbers, and "histograms" (latency.RequestLatency.snapshot)


@dataclasses.dataclass
class Pause:
    """Stop (``paused``) or resume stepping the engine. While paused, requests are accepted and
    aborts and metrics are answered, but no step runs: running requests keep their pages and
    produce nothing until the loop resumes."""

    paused: bool
    reply: Reply  # gets None


@dataclasses.dataclass
class StartProfile:
    """Start a ``jax.profiler`` trace into ``output_dir`` (``num_steps``: stop after that many
    engine steps). ``reply`` gets None, or the ``ProfileError`` that refused it."""

    output_dir: str
    num_steps: int | None
    reply: Reply


@dataclasses.dataclass
class StopProfile:
    reply: Reply  # gets the trace's {output_dir, seconds, files}, or a ProfileError


Message = Generate | Abort | Flush | ClearStorage | GetMetrics | Pause | StartProfile | StopProfile
