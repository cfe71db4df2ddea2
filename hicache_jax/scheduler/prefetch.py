"""The L3 prefetch, owned in one place: started when a request is queued, decided once per
step, waited on when there is nothing else to do.

The scheduler is this object's only user::

    Scheduler.add(req)           -> Prefetcher.start(req)       reads begin in the background
    Engine.step()                -> Prefetcher.decide()         what landed, who still waits
    Scheduler.schedule(decided)  -> Prefetcher.apply(decided)   landed pages into L2 (the tree)
                                    Prefetcher.ready(req)       admission skips a waiting request
    Engine idle                  -> Prefetcher.wait(timeout)    sleep until a read lands

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
"""

from __future__ import annotations

import dataclasses
import time

from hicache_jax.request import Req


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


class Prefetcher:
    """The scheduler's view of L3 prefetching (``storage``: the ``StorageTier``, or None
    when there is no L3 or no radix cache to fill)."""

    def __init__(self, storage=None, *, policy: str = "timeout", reads: bool = True):
        self.storage = storage
        self.policy = policy
        self.reads = reads and storage is not None
        self._waiting: frozenset[str] = frozenset()

    def start(self, req: Req) -> None:
        if self.reads:
            lsl = req.logprob_start_len if req.return_logprob else -1
            self.storage.start(req.prefetch_key, req.input_ids, req.input_len, lsl, req.cache_salt)

    def decide(self) -> PrefetchDecisions:
        """Collect finished reads and decide who still waits (reads the clock; changes no
        cache state)."""
        if not self.reads:
            return NOTHING
        now = time.monotonic()
        landed = tuple(
            Landed(t.tokens, t.salt, t.data, t.hashes, t.end // self.storage.rules.page_size)
            for t in self.storage.take_finished(now)
            if t.status == "done"
        )
        waiting = []
        for key, task in self.storage.tasks.items():
            if task.given_up:
                continue
            reason = self._stop_waiting(task, now)
            if reason is None:
                waiting.append(key)
            else:
                self.storage.counters[reason] += 1
                task.given_up = True  # its reads go on and still land in L2
        return PrefetchDecisions(landed, frozenset(waiting))

    def _stop_waiting(self, task, now: float) -> str | None:
        """Why the task's request stops waiting now (a counter's name), or None."""
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
            self.storage.land(landed)
        self._waiting = decisions.waiting

    def ready(self, req: Req) -> bool:
        """Whether ``req`` may be admitted (as of the last ``apply``)."""
        return req.prefetch_key not in self._waiting

    def pending(self) -> bool:
        """Whether a request is waiting on a read (then an idle step is not a stall)."""
        return bool(self._waiting)

    def wait(self, timeout: float) -> None:
        """Sleep until some read lands, or ``timeout``: an idle scheduler waits here instead
        of spinning, which would also starve the reader threads of the GIL. Processes that
        do not read return at once: process 0's next call tells them what landed."""
        if self.reads:
            self.storage.wait(timeout)
