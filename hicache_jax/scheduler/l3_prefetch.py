"""The L3 prefetch, owned here from start to finish: started when a request is queued,
decided once per step, applied, waited on when there is nothing else to do.

This module is the one owner of a prefetch's state: its task (lifecycle, deadline,
whether its request still waits), the host rows reserved for it, the policy, and every
``prefetch_*`` counter. The storage tier (``cache/storage_tier.py``) only performs reads: it
says what the tree lacks (``look``, ``max_rows``, ``time_limit``), runs one ``L3Read`` on its
threads, and hands back the result in that object; it never changes a task, a counter or a
reservation. Why the owner is here and not there: every decision about a prefetch -- issue it
or not, when its request stops waiting, when it is dropped, what lands in L2 -- is a
scheduling decision, taken on the scheduler thread in step order, and it must be taken in
one place for ``decide`` and ``apply`` to split cleanly (below). The reads are I/O on other
threads; keeping them free of decisions keeps every decision on one thread.

The scheduler is this object's only user (the engine asks the scheduler)::

    Scheduler.add(req)                -> Prefetcher.start(req)      reads begin in the background
    Scheduler.prefetch_decisions()    -> Prefetcher.decide()        what landed, who still waits
    Scheduler.schedule(decided)       -> Prefetcher.apply(decided)  landed pages into L2 (the tree)
                                         Prefetcher.ready(req)      admission skips a waiting request
    Scheduler.wait_for_storage(t)     -> Prefetcher.wait(t)         sleep until a read lands
    Scheduler.abandon_prefetches(d)   -> Prefetcher.abandon(d)      flush: drop every task

``decide`` is the only place that reads a clock or the state of a read; ``apply`` changes the
cache only from the ``PrefetchDecisions`` it is given. That split is what lets several
processes serve one model (``hicache_jax/multihost/replicated.py``): process 0 decides, and its
decisions, landed page data included, travel with its ``step`` call, so every process inserts
the same pages and admits the same requests at the same step. The other processes never read
L3 for a prefetch (``reads=False``); their ``decide`` is never called.

The policy (``hicache_storage_prefetch_policy``) decides when a request stops waiting:
``best_effort`` at once, ``wait_complete`` when its reads are in, ``timeout`` when they are in
or the prompt's timeout has passed (``prefetch_timeout``). Under every policy a request waits
no longer than its task's deadline. A request that stopped waiting still gets what its reads
bring later: they land in L2 for the next request with that prefix.

Bounds (the scheduler thread never waits on L3):
  * each task has a deadline in all (the reads' ``time_limit`` after it starts): past it the
    request stops waiting, whatever the policy, and the task is dropped (its reads
    cancelled), so a hung store cannot hold requests or pile up tasks;
  * host rows: a task reserves, when it is issued, every row it may bring, and holds them
    until it is applied or dropped; with the rows prefetches brought and no request used
    yet (the cache's ``storage_rows``), that is what ``host_rate_limit`` caps;
  * while L3 reads are down (the client's breaker is open) no prefetch is issued.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from hicache_jax.metric_kinds import Metrics
from hicache_jax.request import Req

if TYPE_CHECKING:
    from hicache_jax.cache.prefix_cache import PrefixCache
    from hicache_jax.cache.storage_tier import L3Read, StorageTier


@dataclasses.dataclass(frozen=True)
class Landed:
    """A prefetch whose reads are in: the pages to insert into the host tier (plain data, so
    it can be sent to other processes)."""

    tokens: list[int]
    salt: str | None
    data: dict  # page -> kind -> arrays
    hashes: list
    num_pages: int


@dataclasses.dataclass(frozen=True)
class PrefetchDecisions:
    """What one step learns from L3: reads that landed (inserted in this order) and the
    prefetch keys whose requests must still wait."""

    landed: tuple[Landed, ...] = ()
    waiting: frozenset[str] = frozenset()


NOTHING = PrefetchDecisions()


def prefetch_timeout(num_tokens: int) -> float:
    """How long the ``timeout`` policy waits: grows with the prompt (SGLang's rule)."""
    return min(30.0, 2.0 + 0.1 * num_tokens / 1024)


@dataclasses.dataclass
class PrefetchTask:
    """One request's prefetch, from issue until it is applied or dropped (scheduler thread)."""

    key: str
    read: L3Read  # the storage tier's: its reader threads fill it in
    input_len: int
    rows: int  # host rows reserved for what it may bring
    started: float  # monotonic
    deadline: float  # monotonic time after which it is dropped
    given_up: bool = False  # the request stopped waiting; the reads still land in L2
    handover: bool = False  # a prefill server wrote these pages for it: wait up to the deadline

    @property
    def reading(self) -> bool:
        return self.read.status == "pending"


class Prefetcher:
    """The scheduler's L3 prefetch (``storage``: the ``StorageTier``, or None when there is no
    L3 or no radix cache to fill; ``cache``: the prefix cache the pages land in)."""

    def __init__(
        self,
        storage: StorageTier | None = None,
        cache: PrefixCache | None = None,
        *,
        policy: str = "timeout",
        threshold: int = 256,
        host_rate_limit: float = 0.5,
        reads: bool = True,
    ):
        self.storage = storage
        self.cache = cache
        self.policy = policy
        self.threshold = threshold  # prompt tokens the tree cannot serve, below which no prefetch
        self.host_rate_limit = host_rate_limit
        self.reads = reads and storage is not None
        self.tasks: dict[str, PrefetchTask] = {}
        # key -> a finished read's (probe seconds, read seconds, monotonic time taken), until
        # its request is admitted or gone (``forget``).
        self._timings: dict[str, tuple[float, float, float]] = {}
        self._reserved = 0  # host rows reserved by the tasks in self.tasks
        self._waiting: frozenset[str] = frozenset()
        counters = {
            "prefetch_issued": 0,
            "prefetch_completed": 0,
            "prefetch_revoked": 0,
            "prefetch_timed_out": 0,
            "prefetch_below_threshold": 0,
            "prefetch_refused_host_full": 0,
            "prefetch_skipped_l3_down": 0,
            "prefetch_deadline_exceeded": 0,
            "prefetch_abandoned": 0,
            "prefetch_failed": 0,
            "prefetch_pages": 0,
        }
        self.counters = Metrics().counters(counters)

    # ---- start --------------------------------------------------------------------------
    def start(self, req: Req) -> None:
        """On enqueue: if L3 may extend the tree's match, read it in the background."""
        if not self.reads:
            return
        lsl = req.logprob_start_len if req.return_logprob else -1
        look = self.storage.look(req.input_ids, req.input_len, lsl, req.cache_salt)
        # prefetch_threshold counts the prompt tokens the tree cannot serve (SGLang's rule);
        # what is then read still ends at usable_prefix_end. A handover is read whatever its
        # length: computing the prompt is what the prefill server was there to spare.
        handover = (req.handover or {}).get("status") == "handover"
        short = req.input_len - look.tree_end < self.threshold and not handover
        if short or look.max_end - look.tree_end < self.page_size:
            return
        if not self.storage.reads_available():
            self.counters["prefetch_skipped_l3_down"] += 1
            return
        rows, probes = self.storage.max_rows(look)
        limit = self.host_rate_limit * sum(h.size for h in self.cache.host.values())
        if self.prefetched_rows() + rows > limit:
            self.counters["prefetch_refused_host_full"] += 1
            return
        started = time.monotonic()
        deadline = started + self.storage.time_limit(probes, rows)
        read = self.storage.read(req.input_ids, req.input_len, lsl, req.cache_salt, look, deadline)
        key = req.prefetch_key
        self.tasks[key] = PrefetchTask(key, read, req.input_len, rows, started, deadline, handover=handover)
        self._reserved += rows
        self.counters["prefetch_issued"] += 1

    @property
    def page_size(self) -> int:
        return self.cache.rules.page_size

    # ---- decide (process 0) and apply (every process) ------------------------------------
    def decide(self) -> PrefetchDecisions:
        """Collect finished reads and decide who still waits (reads the clock; changes no
        cache state)."""
        if not self.reads:
            return NOTHING
        now = time.monotonic()
        landed = tuple(
            Landed(t.read.tokens, t.read.salt, t.read.data, t.read.hashes, t.read.end // self.page_size)
            for t in self._take_finished(now)
            if t.read.status == "done"
        )
        waiting = []
        for key, task in self.tasks.items():
            if task.given_up:
                continue
            reason = self._stop_waiting(task, now)
            if reason is None:
                waiting.append(key)
            else:
                self.counters[reason] += 1
                task.given_up = True  # its reads go on and still land in L2
        return PrefetchDecisions(landed, frozenset(waiting))

    def _take_finished(self, now: float) -> list[PrefetchTask]:
        """Remove and return the tasks whose reads finished, in issue order, and drop those
        past their deadline."""
        finished = []
        for key, task in list(self.tasks.items()):
            if task.reading:
                if now > task.deadline:
                    self._drop(key, task)
                    self.counters["prefetch_abandoned"] += 1
                continue
            self._drop(key, task)
            finished.append(task)
            r = task.read
            if not task.given_up:  # its request waited for it, so admission (or abort) forgets it
                self._timings[key] = (r.probe_s, r.read_s, now)
            if task.read.status == "done":
                self.counters["prefetch_completed"] += 1
            elif task.read.status == "below_threshold":
                self.counters["prefetch_below_threshold"] += 1
            else:
                self.counters["prefetch_failed"] += 1
        return finished

    def _stop_waiting(self, task: PrefetchTask, now: float) -> str | None:
        """Why the task's request stops waiting now (a counter's name), or None."""
        if task.handover:  # every policy: only the read's own deadline ends the wait
            return "prefetch_deadline_exceeded" if now > task.deadline else None
        if self.policy == "best_effort":
            return "prefetch_revoked"
        if self.policy == "timeout" and now - task.started > prefetch_timeout(task.input_len):
            return "prefetch_timed_out"
        if now > task.deadline:
            return "prefetch_deadline_exceeded"
        return None

    def apply(self, decisions: PrefetchDecisions) -> None:
        """Insert what landed into the host tier and remember who waits (any process)."""
        for landed in decisions.landed:
            stored = self.cache.insert_host(
                landed.tokens, landed.salt, landed.data, landed.hashes, landed.num_pages
            )
            self.counters["prefetch_pages"] += stored
        self._waiting = decisions.waiting

    def ready(self, req: Req) -> bool:
        """Whether ``req`` may be admitted (as of the last ``apply``)."""
        return req.prefetch_key not in self._waiting

    def forget(self, req: Req) -> None:
        """``req`` is admitted or gone: its read's seconds go to ``req.timing`` (process 0's
        reads; the landing time measured from its arrival)."""
        t = self._timings.pop(req.prefetch_key, None)
        if t is not None:
            probe_s, read_s, taken = t
            req.timing.setdefault("l3_probe_s", probe_s)
            req.timing.setdefault("l3_read_s", read_s)
            req.timing.setdefault("l3_landed_s", max(0.0, taken - req.arrival))

    def waiting(self) -> bool:
        """Whether a request is waiting on a read (then an idle step is not a stall)."""
        return bool(self._waiting)

    # ---- waiting, dropping ---------------------------------------------------------------
    def reading(self) -> bool:
        """Whether a task's reads are still in flight."""
        return any(t.reading for t in self.tasks.values())

    def wait(self, timeout: float) -> None:
        """Sleep until some read lands, or ``timeout``: an idle scheduler waits here instead
        of spinning, which would also starve the reader threads of the GIL. Processes that
        do not read return at once: process 0's next call tells them what landed."""
        if self.reads:
            self.storage.wait_for_reads(timeout if self.reading() else 0.0)

    def abandon(self, deadline: float) -> int:
        """Wait until ``deadline`` (monotonic) for the reads in flight, then drop every task
        (no result is applied) and count those still reading as abandoned; returns that
        count (``StorageTier.drain``, for flush_cache)."""
        while self.reading() and time.monotonic() < deadline:
            self.storage.wait_for_reads(min(0.05, max(0.0, deadline - time.monotonic())))
        abandoned = sum(t.reading for t in self.tasks.values())
        for key, task in list(self.tasks.items()):
            self._drop(key, task)
        self._timings.clear()
        self.counters["prefetch_abandoned"] += abandoned
        return abandoned

    def close(self) -> None:
        """Stop prefetching: every task dropped, its reads cancelled."""
        for key, task in list(self.tasks.items()):
            self._drop(key, task)
        self._timings.clear()

    def _drop(self, key: str, task: PrefetchTask) -> None:
        """Forget a task and release its reservation; a late result is never applied."""
        del self.tasks[key]
        self._reserved -= task.rows
        task.read.cancel()

    def prefetched_rows(self) -> int:
        """Host rows held for prefetches: reserved by tasks in flight, plus rows they
        brought that no request has used yet (the rate limit; the cache keeps that count
        as rows come and go, so this costs nothing)."""
        return self._reserved + self.cache.storage_rows

    def metrics(self) -> Metrics:
        """The ``prefetch_*`` counters and host-row gauges (nothing without L3)."""
        if self.storage is None:
            return Metrics()
        out = self.counters.copy()
        return out.gauges(
            {
                "prefetch_host_rows_in_flight": self._reserved,
                "prefetch_host_rows_used": self.cache.storage_rows,
            }
        )
