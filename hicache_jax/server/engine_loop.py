"""The engine thread: the only code that touches the ``Engine``.

The engine is not thread-safe, and a step blocks for milliseconds to seconds, so it runs in
one thread of its own. The HTTP layer (asyncio) talks to it only through the typed messages
of ``messages.py``, put on a queue; answers come back through ``Reply`` futures and per-request
``Sink`` queues, both resolved with ``loop.call_soon_threadsafe``.

    HTTP handler --Generate/Abort/Flush/...--> queue --> engine thread
         ^                                                    |
         +------ Reply (accepted / flushed / metrics) --------+
         +------ Sink  (Update per step, final output) -------+

A streaming request's updates are ``OutputDelta``s: what is new since the previous one, so a
step costs O(new tokens) whatever the output's length. Other requests get one whole output.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time

from hicache_jax.engine.failures import EngineLost, StepFailed
from hicache_jax.engine.flush_result import FlushResult
from hicache_jax.engine.interface import EngineAPI
from hicache_jax.engine.outputs import OutputDelta, OutputStream
from hicache_jax.metric_kinds import Metrics
from hicache_jax.sampling_params import GRAMMARS, InvalidRequest, SamplingParams
from hicache_jax.server.errors import ApiError
from hicache_jax.server.latency import RequestLatency
from hicache_jax.server.messages import (
    Abort,
    ClearStorage,
    Failure,
    Flush,
    Generate,
    GetMetrics,
    Message,
    Pause,
    Reply,
    Sink,
    StartProfile,
    StopProfile,
    Update,
)
from hicache_jax.server.profiler import ProfileError, Profiler

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0


def _has_grammar(params) -> bool:
    if isinstance(params, dict):
        return any(params.get(f) is not None for f in GRAMMARS)
    return isinstance(params, SamplingParams) and params.constrained


# ---- the loop --------------------------------------------------------------------------------
class EngineLoop:
    def __init__(self, engine: EngineAPI, flush_wait_s: float = 30.0) -> None:
        self.engine = engine
        self.flush_wait_s = flush_wait_s  # how long a flush waits for the requests in flight
        self._queue: queue.Queue[Message] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._streams: dict[str, OutputStream] = {}  # streaming requests, by rid
        self._flushes: list[Flush] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self.started = time.time()
        self.stats = Metrics().counters({"aborted_requests": 0, "engine_errors": 0})
        self.healthy = True
        self.fatal: EngineLost | None = None  # why the engine was lost, if it was
        self.on_fatal = lambda: None  # called on the engine thread then (stops the server)
        self.paused = False  # /pause_generation: no step runs until /continue_generation
        self.latency = RequestLatency()  # TTFT / TPOT / e2e histograms, fed on the engine thread
        self.profiler = Profiler()  # /start_profile, /stop_profile: touched on the engine thread only

    # -- called from asyncio -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, msg: Message) -> None:
        if self._thread.ident is not None and not self._thread.is_alive():
            # Nothing would ever answer: refuse now rather than leave the caller waiting.
            raise ApiError(503, "the engine loop is not running; restart the server")
        self._queue.put(msg)

    async def generate(self, requests: list[dict]) -> list[Sink]:
        """Queue requests (each dict has a ``rid``); raises InvalidRequest if any is refused.
        A request's grammar is compiled first, on a worker thread (``GrammarCompiler``): the
        engine thread then finds it compiled, and no step waits for it."""
        for r in requests:
            params = r.get("sampling_params")
            if _has_grammar(params):
                await asyncio.to_thread(self.engine.compile_grammar, params)
        sinks = [Sink(r["rid"]) for r in requests]
        reply = Reply()
        self.submit(Generate(requests, sinks, reply))
        error = await reply
        if error is not None:
            raise error
        return sinks

    def abort(self, sink: Sink) -> None:
        """Abort the request behind ``sink``, if it still runs. By sink, not by rid: the rid
        may already name a newer request (a client reusing it), which must not be hit."""
        if self._thread.is_alive():  # a dead loop runs nothing (and this is called in finally:)
            self.submit(Abort(sink.rid, sink))

    async def flush(self) -> FlushResult:
        """The engine's flush result (``success``, ``failed`` when it raised), once nothing is
        in flight; refused if requests are still in flight after ``flush_wait_s``."""
        reply = Reply()
        self.submit(Flush(reply, time.monotonic() + self.flush_wait_s))
        return await reply

    async def clear_storage(self, all_namespaces: bool = False) -> tuple[bool, str]:
        reply = Reply()
        self.submit(ClearStorage(reply, all_namespaces))
        return await reply

    async def metrics(self) -> dict:
        reply = Reply()
        self.submit(GetMetrics(reply))
        return await reply

    async def pause(self, paused: bool) -> None:
        """Stop stepping (``True``) or resume (``False``); returns once the engine thread has
        taken it, so no step starts after a pause returns."""
        reply = Reply()
        self.submit(Pause(paused, reply))
        await reply

    async def start_profile(self, output_dir: str, num_steps: int | None = None) -> None:
        """Start a trace between two steps; raises ProfileError if one already runs."""
        reply = Reply()
        self.submit(StartProfile(output_dir, num_steps, reply))
        error = await reply
        if error is not None:
            raise error

    async def stop_profile(self) -> dict:
        """Stop the trace; its {output_dir, seconds, files}. ProfileError if none runs."""
        reply = Reply()
        self.submit(StopProfile(reply))
        result = await reply
        if isinstance(result, ProfileError):
            raise result
        return result

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine loop started")
        try:
            self._serve()
        except EngineLost as e:  # over several processes: stop the server, not only the loop
            log.error("engine lost, stopping the server: %s: %s", type(e).__name__, e)
            self.healthy = False
            self.fatal = e
            self._fail_all(f"the engine stopped: {type(e).__name__}: {e}")
            self.on_fatal()
        except BaseException:
            log.exception("engine loop died; the server is unhealthy")
            self.healthy = False
            self._fail_all("the engine loop died")
            raise
        finally:
            if self.profiler.running:  # a trace left running would be lost
                try:
                    self.profiler.stop()
                except Exception:
                    log.exception("could not stop the profile")
            self.engine.close()  # the engine thread owns the engine: it also shuts it down
            log.info("engine loop stopped")

    def _serve(self) -> None:
        progressed = True
        while not self._stop.is_set():
            # Idle: sleep on the queue (the timeout only lets stop() be noticed). Requests
            # that only wait for L3 prefetches make steps that do nothing: nap, don't spin.
            busy = self.engine.has_unfinished() and not self.paused
            if not busy:
                self._drain(timeout=0.1)
                self.engine.heartbeat()  # over several processes: the others hear from this one
            else:
                self._drain(timeout=None if progressed else 0.001)
            if self.engine.broken is not None:
                self._recover()
            elif self.engine.has_unfinished() and not self.paused:
                progressed = self._step()
            if self._flushes:
                self._flush_or_expire()

    def _drain(self, timeout: float | None) -> None:
        """Handle every queued message; wait up to ``timeout`` s for the first (None: don't)."""
        try:
            msg = self._queue.get_nowait() if timeout is None else self._queue.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            try:
                self._handle(msg)
            except Exception as e:  # one bad message must not stop the loop
                log.exception("engine loop: %s failed", type(msg).__name__)
                self._answer_failure(msg, f"{type(e).__name__}: {e}")
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Message) -> None:
        match msg:
            case Generate():
                self._add(msg)
            case Abort(rid, sink):
                self._abort(rid, sink)
            case Flush():
                self._flushes.append(msg)
            case ClearStorage(reply, all_namespaces):
                reply.set(self._clear_storage(all_namespaces))
            case GetMetrics(reply):
                reply.set(self._metrics())
            case Pause(paused, reply):
                if paused != self.paused:
                    log.info("generation %s", "paused" if paused else "continued")
                self.paused = paused
                reply.set(None)
            case StartProfile(output_dir, num_steps, reply):
                reply.set(self._profile(lambda: self.profiler.start(output_dir, num_steps)))
            case StopProfile(reply):
                reply.set(self._profile(self.profiler.stop))

    def _answer_failure(self, msg: Message, why: str) -> None:
        """Unblock whoever waits on a message whose handling raised."""
        match msg:
            case Generate(reply=reply):
                reply.set(InvalidRequest(f"the request could not be queued: {why}"))
            case Flush(reply=reply):
                reply.set(FlushResult(False, f"flush_cache failed: {why}", failed=True))
            case ClearStorage(reply, _):
                reply.set((False, f"clear_storage failed: {why}"))
            case GetMetrics(reply):
                reply.set(Metrics().counters({"engine_errors": self.stats["engine_errors"]}))
            case Pause(_, reply):
                reply.set(None)
            case StartProfile(_, _, reply) | StopProfile(reply):
                reply.set(ProfileError(why))

    @staticmethod
    def _profile(action):
        try:
            return action()
        except ProfileError as e:
            return e

    def _add(self, msg: Generate) -> None:
        added: list[str] = []
        try:
            for kwargs in msg.requests:
                added.append(self.engine.add_request(**kwargs))
        except Exception as e:  # any refusal must reach the client, not kill the loop
            for rid in added:  # all or none
                if self.engine.abort(rid):
                    self.engine.pop_output(rid)
            if not isinstance(e, InvalidRequest):
                log.exception("add_request failed")
            where = f"request {len(added)}: " if len(msg.requests) > 1 else ""
            kind = type(e) if isinstance(e, InvalidRequest) else InvalidRequest
            msg.reply.set(kind(f"{where}{e}"))
            return
        for sink, rid, kwargs in zip(msg.sinks, added, msg.requests):
            sink.rid = rid  # the engine's name for it (the same, unless the client sent none)
            req = self.engine.requests[rid]  # how long the message waited for the engine thread
            req.timing["loop_wait_s"] = max(0.0, req.arrival - msg.received)
            self._sinks[rid] = sink
            if kwargs.get("stream"):
                self._streams[rid] = OutputStream(self.engine.requests[rid], self.engine.tokenizer)
        msg.reply.set(None)

    def _abort(self, rid: str, sink: Sink) -> None:
        if self._sinks.get(rid) is not sink:
            return  # finished already; the rid may now belong to another request
        if self.engine.abort(rid):  # frees its pages
            self.stats["aborted_requests"] += 1
        req = self.engine.requests.get(rid)
        if req is None or req.finished:  # else the abort was refused: _step delivers it later
            del self._sinks[rid]
            if req is not None:
                sink.put(Update(self._pop(rid), finished=True))
            else:
                self._streams.pop(rid, None)

    def _step(self) -> bool:
        """One engine step and its outputs delivered; False if it produced nothing."""
        try:
            touched = self.engine.step()
        except StepFailed as e:  # the engine failed its running requests and rebuilt itself
            if isinstance(e.__cause__, EngineLost):
                raise e.__cause__ from None  # the processes disagree: nothing can be served
            self.stats["engine_errors"] += 1
            # Health first: a client that sees its request fail may ask /health at once.
            self.healthy = self.engine.broken is None
            self._fail(e.failed, e.message)
            return True
        except EngineLost:
            raise
        except Exception as e:  # unknown state: fail everything in flight, keep serving
            log.exception("engine step failed; aborting every request in flight")
            self.stats["engine_errors"] += 1
            # Unhealthy until a step gets through (a broken engine rebuilds itself first); set
            # before the requests fail, so a client told of its failure never reads 200.
            self.healthy = self.engine.broken is None
            self._fail_all(f"engine error: {type(e).__name__}: {e}")
            return True
        self.healthy = True
        if self.profiler.running:
            self.profiler.stepped()
        now = time.monotonic()
        self._tokens.append((now, self.engine.stats["generated_tokens"]))
        while self._tokens and now - self._tokens[0][0] > THROUGHPUT_WINDOW_S:
            self._tokens.popleft()
        for req in touched:
            sink, stream = self._sinks.get(req.rid), self._streams.get(req.rid)
            if sink is not None and stream is not None and not req.finished and stream.has_news(req):
                sink.put(Update(stream.next(req), finished=False))
        # Every finished request is popped here, touched this step or not.
        for rid in [r for r in self._sinks if self.engine.requests[r].finished]:
            self.latency.observe(self.engine.requests[rid])
            self._sinks.pop(rid).put(Update(self._pop(rid), finished=True))
        return bool(touched)

    def _pop(self, rid: str) -> dict | OutputDelta:
        """A finished request's last update: its whole output, or a streaming one's last delta."""
        stream = self._streams.pop(rid, None)
        return self.engine.pop_output(rid) if stream is None else self.engine.pop_output(rid, stream)

    def _recover(self) -> None:
        """Rebuild a broken engine; unhealthy until it works (retried every 0.5 s)."""
        self.healthy = False
        try:
            self.engine.recover()
        except Exception:
            log.exception("engine recovery failed; retrying")
            self._stop.wait(0.5)
            return
        self.healthy = True

    def _fail(self, rids: list[str], message: str) -> None:
        for rid in rids:
            sink = self._sinks.pop(rid, None)
            self._streams.pop(rid, None)
            if rid in self.engine.requests:
                self.engine.pop_output(rid)
            if sink is not None:
                sink.put(Failure(message))

    def _fail_all(self, message: str) -> None:
        for rid, sink in list(self._sinks.items()):
            try:
                if self.engine.abort(rid) or self.engine.requests[rid].finished:
                    self.engine.pop_output(rid)
            except Exception:
                log.exception("could not abort %s; marking the server unhealthy", rid)
                self.healthy = False
            sink.put(Failure(message))
        self._sinks.clear()
        self._streams.clear()

    def _flush_or_expire(self) -> None:
        """Flush once nothing is in flight; refuse the flushes whose wait is over. New requests
        are never held for a flush (SGLang refuses a flush at once while requests run; this one
        waits a bounded time for them)."""
        if not self.engine.has_unfinished():
            self._flush()
            return
        now = time.monotonic()
        for f in [f for f in self._flushes if now >= f.deadline]:
            self._flushes.remove(f)
            running, waiting = self._in_flight()
            f.reply.set(
                FlushResult(
                    False,
                    f"flush_cache refused: after {now - f.received:.1f}s {running} requests are still "
                    f"running and {waiting} waiting (it waits --flush_cache_wait_s="
                    f"{self.flush_wait_s:g}s for them to end); retry when the server is idle",
                )
            )

    def _in_flight(self) -> tuple[int, int]:
        m = self.engine.metrics()
        return int(m.get("num_running_reqs", 0)), int(m.get("num_waiting_reqs", 0))

    def _flush(self) -> None:
        t0 = time.perf_counter()
        try:
            result = self.engine.flush_cache()  # says what L3 did, or why it refused
        except Exception as e:  # e.g. the integrity check found a leaked page
            log.exception("flush_cache failed")
            result = FlushResult(False, f"flush_cache failed: {type(e).__name__}: {e}", failed=True)
        log.info("flush_cache: %s in %.2fs", result.message, time.perf_counter() - t0)
        for f in self._flushes:
            f.reply.set(result)
        self._flushes.clear()

    def _clear_storage(self, all_namespaces: bool) -> tuple[bool, str]:
        if not self.engine.cfg.hicache_storage_backend:
            return False, "no L3 storage configured (--hicache_storage_backend)"
        try:
            cleared = self.engine.clear_storage(all_namespaces=all_namespaces)
        except Exception as e:
            log.exception("clear_storage failed")
            return False, f"clear_storage failed: {e}"
        what = "every model's L3 pages" if all_namespaces else "this model's L3 pages"
        return cleared, f"{what} cleared" if cleared else "clear_storage refused"

    def _metrics(self) -> Metrics:
        out = Metrics().add(self.engine.metrics()).add(self.stats)
        throughput = 0.0
        if len(self._tokens) >= 2 and time.monotonic() - self._tokens[-1][0] <= THROUGHPUT_WINDOW_S:
            (t0, n0), (t1, n1) = self._tokens[0], self._tokens[-1]
            throughput = (n1 - n0) / max(t1 - t0, 1e-6)
        out.gauges(
            {
                "generation_paused": int(self.paused),
                "gen_throughput": throughput,
                "uptime_s": time.time() - self.started,
            }
        )
        # metrics.render exports both; the second only under sglang:* names
        return out.histograms(
            {"histograms": self.latency.snapshot(), "sglang_histograms": self.latency.sglang_snapshot()}
        )
