"""FCFS (or longest-prefix-first) continuous batching with chunked prefill, mixed
prefill/decode steps and retraction.

Each step walks the running requests oldest first: a decode takes one token, a prefill its
next chunk while the prefill token budget (``chunked_prefill_size``) lasts. Then waiting
requests are admitted in arrival order while the budget, the running limit and memory allow.

Liveness policy: **retract the newest, prefill or decode**. When a running request cannot
get the pages (or state slot) for its step, the most recently admitted running request is
retracted: its computed prefix goes to the radix tree, unlocked and so evictable, its
outputs are kept, and it goes back to the head of the queue. If the request short of
memory is itself the newest, it is the one retracted. Why this and not reserving a whole
prompt's pages at admission: a reservation must assume the worst case (every prompt token
and every possible output token), which on a sliding-window model is many times what the
request ever holds at once and would idle most of the pool; retraction costs at most a
recompute of the pages the tree evicts meanwhile, and only under real pressure.

Why it cannot stall: the oldest running request is never a victim for a newer one, so each
step it gets its pages unless it would not fit even alone (then it fails with an error
naming the shortfall). It advances every step and finishes in bounded time; then the next
oldest does. Retracted requests re-enter ahead of every request that arrived after them, so
none starves. A step with nothing to run while work is queued (and no L3 prefetch is in
flight) can then only mean a bug; the engine raises ``EngineStalled`` after a bounded
number of such steps instead of spinning.

Retraction keeps outputs: sampling draws from per-token seeds, so a resumed request
continues exactly as it would have alone.

Queue order (``schedule_policy``): ``fcfs`` admits in queue order. ``lpm`` admits the
requests with the longest cached prefix first (what ``match`` finds: device and host pages,
and L3 pages once their prefetch has landed), ties in queue order; under pressure that turns
more of the budget into hits. Two bounds keep it live: retracted requests and any request
that has waited ``LPM_AGE_STEPS`` scheduling rounds go first, in queue order, so nothing
waits forever; and a queue longer than ``LPM_MAX_QUEUE`` is taken in queue order (matching
every waiting request each step would cost more than it saves), as SGLang does.

Prefixes shared within a batch are computed once, through the tree. Choices of one prompt
(``n > 1``): a request with ``after`` set waits until that request has computed the prompt
(it has sampled, or finished), whose pages are then in the tree; admitted together, each
would compute it. Any other waiting request whose prompt shares at least a page beyond its
match with a running request's prompt that the running one has not computed yet waits for
it too (``_held``), so it finds those pages in the tree when it is admitted. The wait is
bounded (``hold_limit``: twice the chunks the shared part needs, plus ``HOLD_SLACK``
steps) and ends as soon as the running request has computed the shared part, is
retracted or ends: nothing waits on a request that is not advancing.

Fairness between clients: the choices of one ``n > 1`` request share a ``group``. While a
request of another group waits, a group is not admitted past ``GROUP_SHARE`` of
``max_running_requests`` (at least one row); its next choice is passed over and the others
go first. With nobody else waiting the group takes the whole batch, so the rule costs
nothing when there is no one to be fair to, and a passed-over choice is admitted as soon
as its group's rows end.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from hicache_jax.config import EngineConfig
from hicache_jax.metric_kinds import Metrics
from hicache_jax.request import Req, Status
from hicache_jax.scheduler.cache_adapter import CacheAdapter
from hicache_jax.scheduler.l3_prefetch import NOTHING, PrefetchDecisions, Prefetcher
from hicache_jax.scheduler.plan import StepPlan, WorkItem

HOLD_SLACK = 4  # steps a request may wait for a shared prefix beyond what its chunks need
GROUP_SHARE = 0.5  # of the running batch, the most one group (a request's n choices) holds while others wait
LPM_AGE_STEPS = 64  # lpm: a request waiting this many scheduling rounds goes first
LPM_MAX_QUEUE = 128  # lpm: longer queues are taken in queue order


class OutOfMemory(RuntimeError):
    """A request cannot get its pages even with the pool to itself."""

    def __init__(self, req: Req, message: str):
        super().__init__(message)
        self.req = req


class Scheduler:
    def __init__(self, cfg: EngineConfig, adapter: CacheAdapter, prefetch: Prefetcher | None = None):
        self.cfg = cfg
        self.adapter = adapter
        self.prefetch = prefetch or Prefetcher()  # L3 reads: started on add, gate admission
        self.P = cfg.page_size
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.num_retractions = 0
        self.queued_tokens = 0  # prompt tokens in ``waiting`` (what its bound counts)

    # ---- queue --------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.prefetch.start(req)
        self.waiting.append(req)
        self.queued_tokens += req.input_len

    def abort(self, rid: str) -> Req | None:
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                self.queued_tokens -= r.input_len
                self.prefetch.forget(r)
                return r
        for r in self.running:
            if r.rid == rid:
                self.running.remove(r)
                self.adapter.release(r)
                return r
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Req) -> None:
        """A running request is done: out of the batch, its pages to the tree."""
        self.running.remove(req)
        self.adapter.finish(req)

    def drop(self, req: Req) -> None:
        """Take a running request out and cache nothing it computed (it cannot fit even
        alone, or its device pages are suspect): every page it holds is released."""
        self.running.remove(req)
        self.adapter.release(req)

    def drop_all(self) -> list[Req]:
        """``drop`` every running request, and release what a waiting request holds after a
        half-done admission (an L2 load can fail midway). Returns the dropped requests."""
        dropped = list(self.running)
        for req in dropped:
            self.drop(req)
        for req in self.waiting:
            if req.num_computed or req.cache.last_node is not None:
                self.adapter.release(req)
        return dropped

    # ---- the L3 prefetch (l3_prefetch.py owns it; the engine asks here) -------------------
    def prefetch_decisions(self) -> PrefetchDecisions:
        """What the L3 prefetch brought since the last step, and who still waits for it
        (process 0's decision when several processes serve: multihost/replicated.py)."""
        return self.prefetch.decide()

    def waiting_on_storage(self) -> bool:
        """Whether a waiting request is held by its L3 prefetch (an idle step is no stall)."""
        return self.prefetch.waiting()

    def wait_for_storage(self, timeout: float) -> None:
        """Sleep until an L3 read lands, or ``timeout``."""
        self.prefetch.wait(timeout)

    def abandon_prefetches(self, deadline: float) -> int:
        """For flush_cache: give the reads in flight until ``deadline``, then drop every
        prefetch; returns how many were still reading."""
        return self.prefetch.abandon(deadline)

    def prefetch_metrics(self) -> Metrics:
        return self.prefetch.metrics()

    def close(self) -> None:
        """Stop prefetching (the storage tier is closed after this)."""
        self.prefetch.close()

    # ---- planning -----------------------------------------------------------------------
    def chunk_end(self, req: Req, start: int, budget: int) -> int:
        """Where this step's chunk of ``req`` ends: its budget, the next multiple of
        ``chunked_prefill_size``, and (recurrent layers) the prompt's last page boundary, so a state
        snapshot lands exactly where the same prompt's match will want one."""
        total = req.seq_len
        chunk = self.cfg.chunked_prefill_size
        end = min(total, start + budget, (start // chunk + 1) * chunk)
        if self.adapter.has_state:
            boundary = (total - 1) // self.P * self.P
            if start < boundary < end:
                end = boundary
        return end

    def schedule(self, prefetch: PrefetchDecisions = NOTHING) -> StepPlan | None:
        """Plan one step; ``prefetch``: what L3 brought since the last step, and which
        requests still wait for it (``Prefetcher.decide``)."""
        self.prefetch.apply(prefetch)
        plan = StepPlan(items=[])
        budget = self.cfg.chunked_prefill_size
        for req in list(self.running):  # oldest first
            if req.status is not Status.RUNNING:
                continue  # retracted this step to make room for an older request
            decode = req.remaining == 1
            if not decode and budget <= 0:
                continue
            end = req.num_computed + 1 if decode else self.chunk_end(req, req.num_computed, budget)
            if not self._make_room(req, end):
                break  # req itself was the newest: it and everything newer is retracted
            self._add(plan, req, end)
            if not decode:
                budget -= end - req.num_computed
        for req in self.waiting:
            req.queued_steps += 1
        share = _GroupShare(self.running, self.waiting, self.cfg.max_running_requests)
        for req in share.order(self._queue_order()):
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            if not self.prefetch.ready(req) or not _prompt_ready(req):
                continue  # still prefetching from L3, or waiting for its prompt: others may go first
            match = self.adapter.match(req)
            if self._held(req, match.end):
                continue  # a running request is computing its prefix: others may go first
            end = self.chunk_end(req, match.end, budget)
            if not self.adapter.admit(req, match, end):
                break  # out of memory: FCFS, the rest wait behind it
            self.waiting.remove(req)
            self.queued_tokens -= req.input_len
            self.prefetch.forget(req)
            req.timing.setdefault("admitted_s", time.monotonic() - req.arrival)
            req.status = Status.RUNNING
            self.running.append(req)
            share.admitted(req)
            self._add(plan, req, end)
            budget -= end - match.end
        return plan if plan.items else None

    def _queue_order(self) -> list[Req]:
        """The waiting requests in the order admission tries them (see the module docstring)."""
        queue = list(self.waiting)
        if self.cfg.schedule_policy == "fcfs" or len(queue) > LPM_MAX_QUEUE:
            return queue
        first = [r for r in queue if r.retractions or r.queued_steps >= LPM_AGE_STEPS]
        rest = [r for r in queue if not (r.retractions or r.queued_steps >= LPM_AGE_STEPS)]
        cached = {id(r): self.adapter.match(r).end for r in rest}
        return first + sorted(rest, key=lambda r: -cached[id(r)])  # stable: ties in queue order

    def _held(self, req: Req, matched: int) -> bool:
        """Whether ``req`` (matched up to ``matched``) waits this step for a running request
        still computing a prefix they share, worth at least one more page to ``req``."""
        lsl = req.logprob_start_len if req.return_logprob else -1
        usable = self.adapter.cache.rules.max_end(req.input_len, lsl)  # the most a match can cover
        if usable - matched < self.P:
            return False
        for other in self.running:
            # (one that has computed its whole prompt, or past ``usable``, has nothing to wait for)
            if other.cache_salt != req.cache_salt or other.num_computed >= min(usable, other.input_len):
                continue
            shared = min(_common_prefix(req.input_ids, other.input_ids), usable) // self.P * self.P
            if shared - matched >= self.P and other.num_computed < shared:
                if req.held_steps >= self.hold_limit(shared - matched):
                    return False
                req.held_steps += 1
                return True
        return False

    def hold_limit(self, tokens: int) -> int:
        """Steps a request waits for ``tokens`` of shared prefix to be computed: twice the
        chunks they take (a running request may share the prefill budget), plus slack."""
        return 2 * -(-tokens // self.cfg.chunked_prefill_size) + HOLD_SLACK

    def _make_room(self, req: Req, end: int) -> bool:
        """Pages for ``req`` up to ``end``, retracting newer requests as needed. False when
        ``req`` itself had to go (it was the newest); raises if it cannot fit alone."""
        while not self.adapter.ensure_pages(req, end):
            if self.running[-1] is not req:
                self._retract(self.running[-1])
            elif len(self.running) > 1:
                self._retract(req)
                return False
            else:
                raise OutOfMemory(
                    req,
                    f"request {req.rid}: no KV pages for tokens up to {end} with nothing else "
                    f"running and the cache evicted ({self.adapter.describe_pools()})",
                )
        return True

    def _retract(self, req: Req) -> None:
        """Put a running request back at the head of the queue. Its computed prefix goes to
        the tree (evictable), so it resumes cheaply; its outputs are kept, and per-token seeds
        make the rest come out the same."""
        self.running.remove(req)
        req.computed_before = max(req.computed_before, req.num_computed)
        self.adapter.finish(req)
        req.status = Status.WAITING
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.queued_tokens += req.input_len

    def _add(self, plan: StepPlan, req: Req, end: int) -> None:
        start = req.num_computed
        item = WorkItem(req, start, end, has_initial_state=start > 0)
        held = req.cache
        if held.restore_from is not None:
            plan.copies_before.append((held.restore_from, held.state_slot))
            held.restore_from = None
        if self.adapter.has_state and end % self.P == 0 and end > start:
            slot = self.adapter.snapshot_slot(req, end // self.P)
            if slot is not None:
                plan.copies_after.append((held.state_slot, slot))
        plan.items.append(item)


class _GroupShare:
    """One step's admission counts per group (see the module docstring: fairness)."""

    def __init__(self, running: list[Req], waiting, max_running: int):
        self.limit = max(1, int(max_running * GROUP_SHARE))
        self.running = collections.Counter(r.group for r in running if r.group is not None)
        self.waiting = collections.Counter(r.group for r in waiting)  # None: a lone request
        self.total_waiting = len(waiting)

    def full(self, req: Req) -> bool:
        """Whether ``req``'s group holds its share and a request of another group waits."""
        g = req.group
        return g is not None and self.running[g] >= self.limit and self.total_waiting > self.waiting[g]

    def order(self, queue: list[Req]):
        """``queue`` lazily (each check sees the admissions before it), a request whose group is
        full passed over; then, once the others had their turn, the passed-over ones whose
        group is no longer full (nobody else left waiting)."""
        passed = []
        for req in queue:
            if self.full(req):
                passed.append(req)
            else:
                yield req
        yield from (r for r in passed if not self.full(r))

    def admitted(self, req: Req) -> None:
        self.total_waiting -= 1
        self.waiting[req.group] -= 1
        if req.group is not None:
            self.running[req.group] += 1


def _prompt_ready(req: Req) -> bool:
    """Whether ``req`` may be admitted: it follows no request, or the one it follows (the
    same prompt) has computed its prompt and so put it in the tree."""
    lead = req.after
    if lead is not None and (lead.output_ids or lead.finished):
        req.after = lead = None  # for good: a retraction later does not make it wait again
    return lead is None


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    differ = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(differ.argmax()) if differ.any() else n
