"""L3: writes every host backup to shared storage, and prefetches a prompt's missing
prefix from it on enqueue.

The prefetch ends exactly where the later match will accept a prefix: it asks
``usable_prefix_end`` -- the function the match uses -- over what the tree and L3 hold
together, and reads only what that end needs::

    pages      0 .......................................... end/P - 1
    full       read every page the tree lacks
    sliding    read only the window before `end` (older pages are never read)
    mamba      read the one snapshot at `end`

Reads and existence checks run on background threads; the scheduler thread only starts
tasks and, each step, takes the finished ones (``take_finished``); the prefetch's owner,
``scheduler/prefetch.py``, decides when a request stops waiting and lands what was read in
the host tier (``land``). Results are all or nothing per prefix: after the reads, the end is
recomputed over what actually arrived.

Over several processes (``hicache_jax/multihost/replicated.py``) every process holds the same whole
pages in L2, so any of them could write any page: each writes only the pages whose hash
falls to it (``writer``), and no page is written twice. Only process 0 prefetches; what it
reads reaches the others with its step (``scheduler/prefetch.py``).

One prefetch passes through three thread pools, each because the one before it waits:
  * ``l3-plan`` (here, 2 threads): hashes the prompt, probes L3 for what exists, computes
    ``usable_prefix_end``, then waits for its reads and recomputes the end over what came.
    It needs tree and rule knowledge that the storage client must not have;
  * ``l3-prefetch`` (the client): one read loop per prefetch, batch after batch, stopping
    at the first miss; it waits on each batch's reads;
  * ``l3-read`` (the client): the next batch's read, issued while this one is decoded.
A thread that waits on work queued to its own pool can deadlock once every thread of the
pool waits, so each waiting layer submits to the next pool, never to its own.

Bounds (the scheduler thread never waits on L3):
  * every L3 call has a deadline (the client's ``timeout_s``), and each prefetch task one in
    all (`PrefetchTask.deadline`): past it the request stops waiting, whatever the policy,
    and the task is dropped, so a hung store cannot hold requests or pile up tasks;
  * host rows: a task reserves, when it is issued, every row it may bring, and holds them
    until it is applied or dropped; with the rows prefetches brought and no request used
    yet, that is what ``host_rate_limit`` caps;
  * while L3 reads are down (the client's breaker is open) no prefetch is issued.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.cache.radix import Node
from hicache_jax.metric_kinds import Metrics
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.guard import L3Unavailable
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import page_path
from hicache_jax.storage.prefetch import PrefetchHandle

log = logging.getLogger(__name__)

SUFFIX = {"full": "kv", "swa": "swa", "mamba": "mamba"}


@dataclasses.dataclass
class PrefetchTask:
    key: str
    tokens: list[int]
    input_len: int
    logprob_start_len: int
    salt: str | None
    tree_flags: tuple[list[bool], list[bool], list[bool]]
    tree_end: int
    started: float = dataclasses.field(default_factory=time.monotonic)
    status: str = "pending"  # pending | done | below_threshold | failed
    end: int = 0
    data: dict = dataclasses.field(default_factory=dict)  # page -> kind -> arrays
    hashes: list = dataclasses.field(default_factory=list)
    pages_read: int = 0
    given_up: bool = False  # the request stopped waiting; the reads still land in L2
    rows: int = 0  # host rows reserved for what it may bring
    deadline: float = math.inf  # monotonic time after which it is dropped
    handle: PrefetchHandle | None = None


@dataclasses.dataclass(frozen=True)
class StorageDrain:
    """What a bounded `StorageTier.drain` did."""

    prefetches_abandoned: int  # still reading at the deadline; their results are dropped
    writes_drained: int  # queued L3 page writes settled while draining
    writes_pending: int  # still queued at the deadline (they stay queued, as copies)
    seconds: float

    @property
    def complete(self) -> bool:
        return not self.prefetches_abandoned and not self.writes_pending


class StorageTier:
    def __init__(
        self,
        client: StorageClient,
        namespace: Namespace,
        cache: PrefixCache,
        *,
        threshold: int = 256,
        host_rate_limit: float = 0.5,
        writer: tuple[int, int] = (0, 1),
    ):
        self.client = client
        self.namespace = namespace
        self.cache = cache
        self.rules: PrefixRules = cache.rules
        self.kinds = [k for k in ("full", "swa", "mamba") if k in cache.host]
        self.threshold = threshold
        self.host_rate_limit = host_rate_limit
        self.writer = writer  # (this process, processes): which pages this process writes
        self.timeout_s = client.cfg.timeout_s
        self.tasks: dict[str, PrefetchTask] = {}
        self._progress = threading.Event()  # set whenever a prefetch finishes
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="l3-plan")
        self._reserved = 0  # host rows reserved by tasks in self.tasks (scheduler thread only)
        self._closed = False
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
            "l3_write_errors": 0,
        }
        self.counters = Metrics().counters(counters)
        cache.on_backup = self._on_backup

    # ---- keys ---------------------------------------------------------------------------
    def ns(self, salt: str | None) -> Namespace:
        return self.namespace.with_salt(salt)

    def node_hash(self, node: Node, salt: str | None) -> bytes:
        chain = []
        while not node.is_root and node.hash is None:
            chain.append(node)
            node = node.parent
        prev = node.hash if not node.is_root else None
        for n in reversed(chain):
            (n.hash,) = page_hashes(n.key, self.rules.page_size, self.ns(salt), start_hash=prev)
            prev = n.hash
        return prev

    # ---- writes ---------------------------------------------------------------------------
    def _on_backup(self, node: Node, kinds: tuple[str, ...]) -> None:
        """A node's device data reached the host: queue its L3 write (off this thread)."""
        salt = self.cache.salt_of(node)
        h = self.node_hash(node, salt)
        rank, ranks = self.writer
        if ranks > 1 and int.from_bytes(h[:4], "little") % ranks != rank:
            return  # another process holds the same page and writes it
        ns = self.ns(salt)
        items = [
            (page_path(ns, h, SUFFIX[k]), self.cache.host[k].page(getattr(node, "host_" + k))) for k in kinds
        ]
        fut = self.client.write_async(items, ns)
        fut.add_done_callback(self._write_done)

    def _write_done(self, fut) -> None:
        # Runs on the writer thread: one increment at a time, so no lock is needed. The client
        # has logged the failure (at a bounded rate).
        if fut.exception() is not None:
            self.counters["l3_write_errors"] += 1

    # ---- prefetch ---------------------------------------------------------------------------
    def start(
        self, key: str, tokens: list[int], input_len: int, logprob_start_len: int, salt: str | None
    ) -> None:
        """On enqueue: if L3 may extend the tree's match, look it up in the background."""
        P = self.rules.page_size
        max_end = self.rules.max_end(input_len, logprob_start_len)
        path = self.cache.walk(tokens, max_end // P, salt)
        tree_end = usable_prefix_end(self.rules, input_len, logprob_start_len, *self.cache.availability(path))
        # prefetch_threshold counts the prompt tokens the tree cannot serve (SGLang's rule);
        # what is then read still ends at usable_prefix_end.
        if input_len - tree_end < self.threshold or max_end - tree_end < P:
            return
        if not self.client.reads_available():
            self.counters["prefetch_skipped_l3_down"] += 1
            return
        flags = self.cache.availability(path)
        rows, probes = self._max_rows(flags, max_end)
        limit = self.host_rate_limit * sum(h.size for h in self.cache.host.values())
        if self.prefetched_rows() + rows > limit:
            self.counters["prefetch_refused_host_full"] += 1
            return
        # The task sees every full page of the prompt; only usable_prefix_end keeps the
        # reads short of the end (see tests/cache/test_storage_tier.py).
        task = PrefetchTask(
            key,
            list(tokens[: input_len // P * P]),
            input_len,
            logprob_start_len,
            salt,
            flags,
            tree_end,
            rows=rows,
        )
        # The probes and then the reads, in batches, each within a call deadline, plus one
        # deadline of slack for queueing behind other tasks.
        calls = math.ceil(probes / self.client.batch_size) + math.ceil(rows / self.client.batch_size)
        task.deadline = task.started + self.timeout_s * (1 + calls)
        self._reserved += rows
        self.tasks[key] = task
        self.counters["prefetch_issued"] += 1
        self._pool.submit(self._run, task)

    def _max_rows(self, flags: tuple[list[bool], list[bool], list[bool]], max_end: int) -> tuple[int, int]:
        """(the most host rows a task may bring, the existence probes it makes): the pages
        before `max_end` the tree lacks are probed; of those it reads every full page, at
        most one window of sliding-window pages and one Mamba snapshot."""
        k = max_end // self.rules.page_size
        lacks = dict(
            zip(("full", "swa", "mamba"), (sum(not (j < len(f) and f[j]) for j in range(k)) for f in flags))
        )
        rows = lacks["full"] if "full" in self.kinds else 0
        if "swa" in self.kinds:
            rows += min(lacks["swa"], len(self.rules.swa_pages_needed(k * self.rules.page_size)))
        if "mamba" in self.kinds:
            rows += min(lacks["mamba"], 1)
        return rows, sum(lacks[kind] for kind in self.kinds)

    def _run(self, task: PrefetchTask) -> None:
        try:
            self._plan_and_read(task)
        except L3Unavailable:
            task.status = "failed"  # L3 is down: counted and logged by the client's guard
        except Exception as e:  # an I/O failure is a miss, never a crash
            if not self._closed:
                self.client.ratelog.warning(
                    "tier-prefetch", "L3 prefetch failed (a miss): %s: %s", type(e).__name__, e
                )
            task.status = "failed"
        self._progress.set()

    def wait(self, timeout: float) -> None:
        """Block until some prefetch finishes (or ``timeout``): an idle scheduler waits here
        instead of spinning, which would also starve the reader threads of the GIL."""
        if any(t.status == "pending" for t in self.tasks.values()):
            self._progress.wait(timeout)
        self._progress.clear()

    def _flags(self, task: PrefetchTask, have: dict[tuple[str, int], bool], n: int):
        tf = dict(zip(("full", "swa", "mamba"), task.tree_flags))
        return [
            [(j < len(tf[k]) and tf[k][j]) or have.get((k, j), False) for j in range(n)]
            for k in ("full", "swa", "mamba")
        ]

    def _plan_and_read(self, task: PrefetchTask) -> None:
        P = self.rules.page_size
        n = len(task.tokens) // P
        ns = self.ns(task.salt)
        task.hashes = page_hashes(task.tokens[: n * P], P, ns)
        tree = dict(zip(("full", "swa", "mamba"), task.tree_flags))
        probe = [(k, j) for k in self.kinds for j in range(n) if not (j < len(tree[k]) and tree[k][j])]
        found = self.client.exists([page_path(ns, task.hashes[j], SUFFIX[k]) for k, j in probe])
        have = {kj: ok for kj, ok in zip(probe, found)}
        end = usable_prefix_end(
            self.rules, task.input_len, task.logprob_start_len, *self._flags(task, have, n)
        )
        if end <= task.tree_end:
            task.status = "below_threshold"  # L3 cannot extend the match
            return
        need = self._needed(task, end)
        task.handle = handle = self.client.prefetch(
            [page_path(ns, task.hashes[j], SUFFIX[k]) for k, j in need], ns
        )
        if time.monotonic() > task.deadline:
            handle.cancel()  # dropped while probing: read nothing more
        pages = handle.result()
        got = dict(zip(need, pages))  # the longest good run, in page order
        arrived = {kj: True for kj in got}
        end = usable_prefix_end(
            self.rules, task.input_len, task.logprob_start_len, *self._flags(task, arrived, n)
        )
        for (k, j), page in got.items():
            if (k, j) in self._needed(task, end):
                task.data.setdefault(j, {})[k] = page
        task.pages_read = len(pages)
        task.end = end
        task.status = "done" if end > task.tree_end else "failed"

    def _needed(self, task: PrefetchTask, end: int) -> list[tuple[str, int]]:
        """(kind, page) reads the end needs that the tree lacks, in page order."""
        tree = dict(zip(("full", "swa", "mamba"), task.tree_flags))
        lacks = lambda k, j: not (j < len(tree[k]) and tree[k][j])  # noqa: E731
        k_pages = end // self.rules.page_size
        need = []
        window = set(self.rules.swa_pages_needed(end))
        for j in range(k_pages):
            if "full" in self.kinds and lacks("full", j):
                need.append(("full", j))
            if "swa" in self.kinds and j in window and lacks("swa", j):
                need.append(("swa", j))
        if "mamba" in self.kinds and k_pages and lacks("mamba", k_pages - 1):
            need.append(("mamba", k_pages - 1))
        return need

    def take_finished(self, now: float) -> list[PrefetchTask]:
        """Remove and return the tasks that finished, in issue order, and drop those past
        their deadline (scheduler thread only; the prefetch owner, ``scheduler/prefetch.py``,
        decides what to do with them)."""
        finished = []
        for key, task in list(self.tasks.items()):
            if task.status == "pending":
                if now > task.deadline:
                    self._drop(key, task)
                    self.counters["prefetch_abandoned"] += 1
                continue
            self._drop(key, task)
            finished.append(task)
            if task.status == "done":
                self.counters["prefetch_completed"] += 1
            elif task.status == "below_threshold":
                self.counters["prefetch_below_threshold"] += 1
            else:
                self.counters["prefetch_failed"] += 1
        return finished

    def land(self, landed) -> None:
        """Insert a finished prefetch's pages into the host tier (a ``prefetch.Landed``)."""
        stored = self.cache.insert_host(
            landed.tokens, landed.salt, landed.data, landed.hashes, landed.num_pages
        )
        self.counters["prefetch_pages"] += stored

    def _drop(self, key: str, task: PrefetchTask) -> None:
        """Forget a task and release its reservation; a late result is never applied."""
        del self.tasks[key]
        self._reserved -= task.rows
        if task.status == "pending" and task.handle is not None:
            task.handle.cancel()

    def prefetched_rows(self) -> int:
        """Host rows held for prefetches: reserved by tasks in flight, plus rows they
        brought that no request has used yet (the rate limit; the cache keeps that count
        as rows come and go, so this costs nothing)."""
        return self._reserved + self.cache.storage_rows

    # ---- maintenance ---------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> StorageDrain:
        """Wait, for at most `timeout` (default: one call deadline) in all, for in-flight
        prefetches (their results are dropped) and then for queued L3 writes: flush_cache
        keeps L3 and should lose no write, but must answer."""
        t0 = time.monotonic()
        deadline = t0 + (self.timeout_s if timeout is None else timeout)
        while any(t.status == "pending" for t in self.tasks.values()) and time.monotonic() < deadline:
            self._progress.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._progress.clear()
        abandoned = sum(t.status == "pending" for t in self.tasks.values())
        for key, task in list(self.tasks.items()):
            self._drop(key, task)
        self.counters["prefetch_abandoned"] += abandoned
        writes = self.client.drain(max(0.0, deadline - time.monotonic()))
        if abandoned or writes.pending:
            log.warning(
                "L3 drain stopped at its deadline: %d prefetches abandoned, %d writes still queued",
                abandoned,
                writes.pending,
            )
        return StorageDrain(abandoned, writes.written, writes.pending, time.monotonic() - t0)

    def clear(self) -> None:
        self.client.clear()

    def close(self, timeout: float | None = None) -> None:
        """Stop prefetching and close the client (its queued writes get up to `timeout`)."""
        self._closed = True
        for key, task in list(self.tasks.items()):
            self._drop(key, task)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close(timeout)

    def stats(self) -> Metrics:
        out = self.counters.copy().add(self.client.stats(), prefix="l3_")
        out.gauges(
            {
                "prefetch_host_rows_in_flight": self._reserved,
                "prefetch_host_rows_used": self.cache.storage_rows,
            }
        )
        return out.add(self.client.health(), prefix="storage_")

    def pending(self) -> Sequence[PrefetchTask]:
        return [t for t in self.tasks.values() if t.status == "pending"]
