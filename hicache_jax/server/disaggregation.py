"""Prefill/decode disaggregation through the shared L3 (``--disaggregation_mode``).

sglang-router's PD mode sends every request body to a prefill and a decode server at once,
both copies carrying the same ``bootstrap_room``, and answers with the decode server's
response. No transfer engine pairs the two here: the L3 both servers share carries the KV::

    prefill server                                decode server
    compute the prompt (max_new_tokens=1)         wait for marker <room> (--disaggregation_wait_s)
    its pages reach L3 (write-through)            load the prompt from L3: an ordinary hit
    poll L3 until they are all there             (read whatever --hicache_prefetch_threshold)
    publish marker <room> {done, end}  ------->   decode; its own new pages go to L3 as usual
    answer (no input logprobs: the decode
    server computes those)

A prompt's pages are content-addressed, so the decode server finds them by hashing the prompt
as any L3 hit does; the marker only says when to stop waiting and how far L3 reaches. When
none comes in time (the prefill server died, L3 is down), or it says ``failed``, or it names
another namespace (the two servers do not share pages: another model, page size or drafter),
the decode server computes the prompt itself: nothing is lost, ``meta_info.disaggregation``
says it fell back and why, and ``/metrics`` counts it (``hicache_pd_fallbacks_total``).

Markers are hints, never data: a forged one can at most end a wait early, since every page is
checked (checksum, and HMAC with an auth key) as it is read. The decode server deletes the
markers it reads; the rest are swept by age and number (``storage/handover.py``) by each
prefill server at most once a minute, and by the fleet evictor each tick when L3 is capped.

A ``bootstrap_room`` on a server with ``--disaggregation_mode null`` is accepted and changes
nothing: it serves the whole request, as SGLang's does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from fastapi import Request

from hicache_jax.metric_kinds import Metrics
from hicache_jax.sampling_params import InvalidRequest
from hicache_jax.server.rooms import ROOM
from hicache_jax.server.streaming import Watch, wait_whole
from hicache_jax.storage.handover import Handover, HandoverBoard
from hicache_jax.storage.layout import namespace_dir

log = logging.getLogger(__name__)

POLL_S = (0.005, 0.1)  # L3 polls: first interval, doubling up to the second
SWEEP_EVERY_S = 60.0  # a prefill server's sweep of stale markers (also the fleet evictor's, each tick)
WRITE_WAIT_CALLS = 3  # a prefill's wait for its pages, in L3 call deadlines (--hicache_storage_timeout_s)
# ``Engine.check_request``'s arguments, as an engine request dict names them.
CHECKED = (
    "input_ids",
    "text",
    "sampling_params",
    "rid",
    "logprob_start_len",
    "top_logprobs_num",
    "cache_salt",
)


class Disaggregation:
    """This server's role: what a request with a ``bootstrap_room`` does before (decode) or
    instead of (prefill) the ordinary path. Runs on the HTTP event loop; L3 calls go to
    worker threads."""

    def __init__(self, mode: str, wait_s: float, storage=None, check=None, server_id: str | None = None):
        if mode != "null" and storage is None:
            raise ValueError(f"disaggregation_mode {mode} needs an L3 storage tier")
        self.mode = mode
        self.wait_s = wait_s
        self.storage = storage  # cache/storage_tier.StorageTier: durable_end, ns, client
        self.check = check  # Engine.check_request: a decode server refuses before it waits
        # Prefill: how long a finished prompt's pages may take to reach L3 (a few L3 call
        # deadlines: the write queue's) before its marker says how far they got.
        self.write_wait_s = WRITE_WAIT_CALLS * storage.timeout_s if storage is not None else 0.0
        self.board = HandoverBoard(storage.client.store) if mode != "null" else None
        self.server_id = server_id or f"{socket.gethostname()}-{os.getpid()}"
        self._next_sweep = 0.0  # monotonic: a prefill server sweeps at most every SWEEP_EVERY_S
        self.counters = Metrics().counters(
            {
                "pd_handovers": 0,  # decode: a marker said done, and the prompt was read from L3
                "pd_fallbacks": 0,  # decode: no usable marker in time; the prompt was computed here
                "pd_wait_seconds": 0.0,  # decode: time spent waiting for markers
                "pd_markers_published": 0,  # prefill: done markers
                "pd_markers_failed": 0,  # prefill: failed markers (the prompt could not be handed over)
                "pd_markers_swept": 0,  # prefill: markers past their age or number bound, deleted
            }
        )

    @classmethod
    def from_engine(cls, engine) -> Disaggregation:
        cfg = engine.cfg
        return cls(cfg.disaggregation_mode, cfg.disaggregation_wait_s, engine.storage, engine.check_request)

    def active(self, reqs: list[dict]) -> bool:
        return self.mode != "null" and any(r.get(ROOM) is not None for r in reqs)

    async def run(self, loop, request: Request, reqs: list[dict]) -> list[dict] | None:
        """Take each request's room off it; then, on a prefill server, serve them as the
        prefill role and return the outputs to answer with; on a decode server, wait for
        their markers and record each one's handover (``Req.handover``), returning None: the
        caller serves them as usual. Requests without a room go the ordinary way."""
        rooms = [r.pop(ROOM, None) for r in reqs]
        if self.mode == "null" or all(room is None for room in rooms):
            return None
        if self.mode == "decode":
            for r in reqs:  # a request the engine would refuse gets its 400 now, not after the wait
                self.check(**{k: r.get(k) for k in CHECKED if k in r})
            await self._await_handovers(reqs, rooms)
            return None
        return await self._prefill(loop, request, reqs, rooms)

    async def _l3(self, fn, *args):
        """``fn(*args)`` on a worker thread, within one L3 call deadline (TimeoutError past
        it; the thread is left to finish on its own, as ``StoreGuard`` leaves its calls)."""
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.storage.timeout_s)

    # ---- decode ---------------------------------------------------------------------------
    async def _await_handovers(self, reqs: list[dict], rooms: list[int | None]) -> None:
        distinct = {room: r for r, room in zip(reqs, rooms) if room is not None}
        got = await asyncio.gather(
            *(self._await_one(room, r.get("cache_salt")) for room, r in distinct.items())
        )
        records = dict(zip(distinct, got))
        for r, room in zip(reqs, rooms):
            if room is not None:
                r["handover"] = dict(records[room])

    async def _await_one(self, room: int, salt: str | None) -> dict:
        t0 = time.monotonic()
        deadline = t0 + self.wait_s
        pause = POLL_S[0]
        marker = None
        while True:
            try:
                marker = await self._l3(self.board.read, room)
            except Exception as e:  # L3 unreachable: keep trying until the deadline
                log.debug("reading handover marker %s failed: %s", room, e)
            if marker is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, POLL_S[1])
        waited = time.monotonic() - t0
        self.counters["pd_wait_seconds"] += waited
        record = {"room": room, "wait_s": round(waited, 6)}
        if marker is None:
            return self._fell_back(record, f"no handover marker within {self.wait_s:g} s")
        await self._l3(self._consume, room)
        own = namespace_dir(self.storage.ns(salt))
        if marker.status != "done":
            return self._fell_back(record, f"the prefill server could not hand it over: {marker.message}")
        if marker.namespace != own:
            return self._fell_back(
                record,
                f"the prefill server writes namespace {marker.namespace}, this server reads {own} "
                "(another model, page size, KV layout or drafter): no page can be shared",
            )
        self.counters["pd_handovers"] += 1
        return dict(record, status="handover", end=marker.end, prefill_server=marker.server)

    def _fell_back(self, record: dict, reason: str) -> dict:
        self.counters["pd_fallbacks"] += 1
        log.info("PD fallback for room %s: %s", record["room"], reason)
        return dict(record, status="fallback", reason=reason)

    def _consume(self, room: int) -> None:
        try:
            self.board.consume(room)
        except Exception as e:  # a marker left behind is swept by age
            log.debug("deleting handover marker %s failed: %s", room, e)

    # ---- prefill --------------------------------------------------------------------------
    async def _prefill(self, loop, request, reqs, rooms) -> list[dict] | None:
        jobs = [_prefill_job(r) for r in reqs]
        try:
            if any(r.get("input_ids") is None for r in jobs):
                raise InvalidRequest("the prefill role needs token ids: this model has no tokenizer for text")
            watch = Watch(loop, await loop.generate(jobs), request)
        except Exception as e:  # refused: the decode server must not wait for it
            await self._publish_failed(reqs, rooms, f"{type(e).__name__}: {e}")
            raise
        outs = await wait_whole(watch)
        if outs is None:
            await self._publish_failed(reqs, rooms, "the prefill request was cancelled (its client left)")
            return None
        done: dict[int, Handover] = {}
        for r, room, out in zip(reqs, rooms, outs):
            if room is None or room in done:
                continue
            reason = (out["meta_info"].get("finish_reason") or {}).get("type")
            if reason == "abort":
                message = (out["meta_info"]["finish_reason"] or {}).get("message", "aborted")
                done[room] = await self._publish(room, r, 0, "failed", f"the prefill was aborted: {message}")
            else:
                end, target = await self._durable(r)
                status = "done" if end > 0 or target == 0 else "failed"
                why = (
                    "" if status == "done" else f"none of its pages reached L3 within {self.write_wait_s:g} s"
                )
                done[room] = await self._publish(room, r, end, status, why)
        for out, room in zip(outs, rooms):
            if room is not None:
                out["meta_info"]["disaggregation"] = {
                    "room": room,
                    "status": done[room].status,
                    "end": done[room].end,
                }
            for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
                if key in out["meta_info"]:  # the decode server's answer carries them
                    out["meta_info"][key] = []
        return outs

    async def _durable(self, r: dict) -> tuple[int, int]:
        """(how far L3 serves the prompt now, how far it can): polled until equal or the wait
        runs out. The pages were queued for L3 when the request finished (write-through)."""
        ids, salt = r["input_ids"], r.get("cache_salt")
        deadline = time.monotonic() + self.write_wait_s
        pause = POLL_S[0]
        end, target = 0, self.storage.rules.max_end(len(ids))
        while True:
            try:
                end, target = await self._l3(self.storage.durable_end, ids, len(ids), salt)
            except Exception as e:  # L3 unreachable or slow: poll again until the deadline
                log.debug("checking the handover pages of %d tokens failed: %s", len(ids), e)
            if end >= target or time.monotonic() >= deadline:
                return end, target
            await asyncio.sleep(pause)
            pause = min(2 * pause, POLL_S[1])

    async def _publish(self, room: int, r: dict, end: int, status: str, message: str = "") -> Handover:
        marker = Handover(
            room=room,
            status=status,
            namespace=namespace_dir(self.storage.ns(r.get("cache_salt"))),
            end=end,
            input_len=len(r.get("input_ids") or ()),
            server=self.server_id,
            written=time.time(),
            message=message,
        )
        try:
            await self._l3(self.board.publish, marker)
        except Exception as e:  # the decode server waits out its deadline and computes it
            log.warning("publishing handover marker %s failed: %s", room, e)
            status = "failed"
        self.counters["pd_markers_published" if status == "done" else "pd_markers_failed"] += 1
        if time.monotonic() >= self._next_sweep:  # markers no decode server took: bounded
            self._next_sweep = time.monotonic() + SWEEP_EVERY_S
            try:
                swept = await self._l3(self.board.sweep)
                self.counters["pd_markers_swept"] += swept
            except Exception as e:  # the next one, or the fleet evictor, tries again
                log.debug("sweeping handover markers failed: %s", e)
        return marker

    async def _publish_failed(self, reqs: list[dict], rooms: list[int | None], message: str) -> None:
        for room in dict.fromkeys(r for r in rooms if r is not None):
            r = reqs[rooms.index(room)]
            await self._publish(room, r, 0, "failed", message)


def _prefill_job(r: dict) -> dict:
    """The prefill role's engine request for ``r``: the prompt, computed once; one token is
    sampled greedily and nothing else is asked (no logprobs, grammar or stream), so the step
    work is the prompt's."""
    job = {k: r[k] for k in ("rid", "input_ids", "cache_salt", "after", "group") if k in r}
    job["sampling_params"] = {"max_new_tokens": 1, "temperature": 0.0}
    return job
