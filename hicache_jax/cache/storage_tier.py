"""L3: writes every host backup to shared storage, and performs the reads of a prompt's
missing prefix for the prefetch's owner, ``scheduler/l3_prefetch.py``.

The reads end exactly where the later match will accept a prefix: they ask
``usable_prefix_end`` -- the function the match uses -- over what the tree and L3 hold
together, and read only what that end needs::

    pages      0 .......................................... end/P - 1
    EVERY      read every page the tree lacks
    WINDOW     read only the window before `end` (older pages are never read)
    SNAPSHOT   read the one snapshot at `end`

(each cache kind by its retention rule, ``PrefixRules.pages_needed``).

This side only performs reads and hands back results: ``look`` (what the tree holds along a
prompt), ``max_rows`` and ``time_limit`` (what a read may bring and how long it may take),
``read`` (start one ``L3Read``), ``wait_for_reads``. Its reader threads write only the
``L3Read`` they run; the owner decides everything else (issue, deadline, reservation, policy,
counters, landing). Results are all or nothing per prefix: after the reads, the end is
recomputed over what actually arrived.

Over several processes (``hicache_jax/multihost/replicated.py``) every process holds the same whole
pages in L2, so any of them could write any page: each writes only the pages whose hash
falls to it (``writer``), and no page is written twice. Only process 0 prefetches; what it
reads reaches the others with its step (``scheduler/l3_prefetch.py``).

One read passes through three thread pools, each because the one before it waits:
  * ``l3-plan`` (here, 2 threads): hashes the prompt, probes L3 for what exists, computes
    ``usable_prefix_end``, then waits for its reads and recomputes the end over what came.
    It needs tree and rule knowledge that the storage client must not have;
  * ``l3-prefetch`` (the client): one read loop per prefetch, batch after batch, stopping
    at the first miss; it waits on each batch's reads;
  * ``l3-read`` (the client): the next batch's read, issued while this one is decoded.
A thread that waits on work queued to its own pool can deadlock once every thread of the
pool waits, so each waiting layer submits to the next pool, never to its own. Every L3 call
has a deadline (the client's ``timeout_s``); a read past its own deadline (set by the owner)
reads no further batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.cache.radix import Node
from hicache_jax.kinds import L3_SUFFIX
from hicache_jax.metric_kinds import Metrics
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.guard import L3Unavailable
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import page_path
from hicache_jax.storage.read_handle import PrefetchHandle

log = logging.getLogger(__name__)

SUFFIX = L3_SUFFIX


@dataclasses.dataclass(frozen=True)
class TreeLook:
    """What the tree holds along one prompt, before any I/O (``StorageTier.look``)."""

    flags: dict[str, list[bool]]  # per cache kind, per page: the tree holds it in some tier
    tree_end: int  # usable_prefix_end over the tree alone
    max_end: int  # the most any match of the prompt may use


@dataclasses.dataclass
class L3Read:
    """One prompt's read. The inputs are set when it starts; the results are written by the
    reader threads only, ``status`` last: the owner reads the rest once it is not pending."""

    tokens: list[int]  # the prompt's full pages
    input_len: int
    logprob_start_len: int
    salt: str | None
    tree_flags: dict[str, list[bool]]
    tree_end: int
    deadline: float = math.inf  # monotonic: past it no further batch is read
    status: str = "pending"  # pending | done | below_threshold | failed
    end: int = 0
    data: dict = dataclasses.field(default_factory=dict)  # page -> kind -> arrays
    hashes: list = dataclasses.field(default_factory=list)
    pages_read: int = 0
    handle: PrefetchHandle | None = None
    probe_s: float = 0.0  # the existence checks
    read_s: float = 0.0  # the page reads

    def cancel(self) -> None:
        """Read no further batch (the owner dropped it)."""
        if self.status == "pending" and self.handle is not None:
            self.handle.cancel()


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
        writer: tuple[int, int] = (0, 1),
    ):
        self.client = client
        self.namespace = namespace
        self.cache = cache
        self.rules: PrefixRules = cache.rules
        self.kinds = [k for k in cache.rules.kinds if k in cache.host]
        self.writer = writer  # (this process, processes): which pages this process writes
        self.timeout_s = client.cfg.timeout_s
        self._progress = threading.Event()  # set whenever a read finishes
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="l3-plan")
        self._closed = False
        self.counters = Metrics().counters({"l3_write_errors": 0})
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
        items = [(page_path(ns, h, SUFFIX[k]), self.cache.host[k].page(node.host[k])) for k in kinds]
        fut = self.client.write_async(items, ns)
        fut.add_done_callback(self._write_done)

    def _write_done(self, fut) -> None:
        # Runs on the writer thread: one increment at a time, so no lock is needed. The client
        # has logged the failure (at a bounded rate).
        if fut.exception() is not None:
            self.counters["l3_write_errors"] += 1

    # ---- reads, for the prefetch owner (scheduler/l3_prefetch.py) ---------------------------
    def reads_available(self) -> bool:
        """False while L3 reads are down (the client's breaker is open)."""
        return self.client.reads_available()

    def look(self, tokens: list[int], input_len: int, logprob_start_len: int, salt: str | None) -> TreeLook:
        """What the tree holds along ``tokens``, and how far a match may reach."""
        max_end = self.rules.max_end(input_len, logprob_start_len)
        path = self.cache.walk(tokens, max_end // self.rules.page_size, salt)
        flags = self.cache.availability(path)
        tree_end = usable_prefix_end(self.rules, input_len, logprob_start_len, flags)
        return TreeLook(flags, tree_end, max_end)

    def time_limit(self, probes: int, rows: int) -> float:
        """Seconds a read of ``probes`` existence checks and ``rows`` pages may take: the
        probes and then the reads, in batches, each within a call deadline, plus one
        deadline of slack for queueing behind other reads."""
        calls = math.ceil(probes / self.client.batch_size) + math.ceil(rows / self.client.batch_size)
        return self.timeout_s * (1 + calls)

    def read(
        self,
        tokens: list[int],
        input_len: int,
        logprob_start_len: int,
        salt: str | None,
        look: TreeLook,
        deadline: float,
    ) -> L3Read:
        """Start reading what L3 adds to the tree's match of ``tokens`` (in the background)."""
        # The read sees every full page of the prompt; only usable_prefix_end keeps it
        # short of the end (see tests/cache/test_storage_tier.py).
        P = self.rules.page_size
        read = L3Read(
            list(tokens[: input_len // P * P]),
            input_len,
            logprob_start_len,
            salt,
            look.flags,
            look.tree_end,
            deadline=deadline,
        )
        self._pool.submit(self._run, read)
        return read

    def max_rows(self, look: TreeLook) -> tuple[int, int]:
        """(the most host rows a read may bring, the existence probes it makes): the pages
        before `max_end` the tree lacks are probed; of those it reads at most what a prefix
        ending at `max_end` needs of each kind (every page, one window, one snapshot)."""
        k = look.max_end // self.rules.page_size
        lacks = {kind: sum(not (j < len(f) and f[j]) for j in range(k)) for kind, f in look.flags.items()}
        rows = sum(min(lacks[kind], len(self.rules.pages_needed(kind, look.max_end))) for kind in self.kinds)
        return rows, sum(lacks[kind] for kind in self.kinds)

    def _run(self, read: L3Read) -> None:
        try:
            self._plan_and_read(read)
        except L3Unavailable:
            read.status = "failed"  # L3 is down: counted and logged by the client's guard
        except Exception as e:  # an I/O failure is a miss, never a crash
            if not self._closed:
                self.client.ratelog.warning(
                    "tier-prefetch", "L3 prefetch failed (a miss): %s: %s", type(e).__name__, e
                )
            read.status = "failed"
        self._progress.set()

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a read finished since the last call, or ``timeout`` (0: do not block)."""
        self._progress.wait(timeout)
        self._progress.clear()

    def _flags(self, read: L3Read, have: dict[tuple[str, int], bool], n: int) -> dict[str, list[bool]]:
        tf = read.tree_flags
        return {
            k: [(j < len(f) and f[j]) or have.get((k, j), False) for j in range(n)] for k, f in tf.items()
        }

    def _plan_and_read(self, read: L3Read) -> None:
        P = self.rules.page_size
        n = len(read.tokens) // P
        ns = self.ns(read.salt)
        read.hashes = page_hashes(read.tokens[: n * P], P, ns)
        tree = read.tree_flags
        probe = [(k, j) for k in self.kinds for j in range(n) if not (j < len(tree[k]) and tree[k][j])]
        t0 = time.monotonic()
        found = self.client.exists([page_path(ns, read.hashes[j], SUFFIX[k]) for k, j in probe])
        read.probe_s = time.monotonic() - t0
        have = {kj: ok for kj, ok in zip(probe, found)}
        end = usable_prefix_end(
            self.rules, read.input_len, read.logprob_start_len, self._flags(read, have, n)
        )
        if end <= read.tree_end:
            read.status = "below_threshold"  # L3 cannot extend the match
            return
        need = self._needed(read, end)
        read.handle = handle = self.client.prefetch(
            [page_path(ns, read.hashes[j], SUFFIX[k]) for k, j in need], ns
        )
        if time.monotonic() > read.deadline:
            handle.cancel()  # dropped while probing: read nothing more
        t0 = time.monotonic()
        pages = handle.result()
        read.read_s = time.monotonic() - t0
        got = dict(zip(need, pages))  # the longest good run, in page order
        arrived = {kj: True for kj in got}
        end = usable_prefix_end(
            self.rules, read.input_len, read.logprob_start_len, self._flags(read, arrived, n)
        )
        for (k, j), page in got.items():
            if (k, j) in self._needed(read, end):
                read.data.setdefault(j, {})[k] = page
        read.pages_read = len(pages)
        read.end = end
        read.status = "done" if end > read.tree_end else "failed"

    def _needed(self, read: L3Read, end: int) -> list[tuple[str, int]]:
        """(kind, page) reads the end needs that the tree lacks, in page order."""
        tree = read.tree_flags
        need = [
            (j, i, k)
            for i, k in enumerate(self.kinds)
            for j in self.rules.pages_needed(k, end)
            if not (j < len(tree[k]) and tree[k][j])
        ]
        return [(k, j) for j, _, k in sorted(need)]

    # ---- handover (prefill/decode disaggregation) -------------------------------------------
    def durable_end(self, tokens: list[int], input_len: int, salt: str | None) -> tuple[int, int]:
        """(how far L3 alone serves ``tokens``, the most any match may use): the prefix end a
        decode server's match would accept from L3's pages only, by the same
        ``usable_prefix_end``. Callable from any thread: it reads only this tier's fixed
        settings and the client, whose calls are thread-safe."""
        P = self.rules.page_size
        max_end = self.rules.max_end(input_len)
        n = max_end // P
        ns = self.ns(salt)
        hashes = page_hashes(list(tokens[: n * P]), P, ns)
        probe = [(k, j) for k in self.kinds for j in range(n)]
        found = self.client.exists([page_path(ns, hashes[j], SUFFIX[k]) for k, j in probe])
        held = {k: [False] * n for k in self.rules.kinds}
        for (k, j), ok in zip(probe, found):
            held[k][j] = ok
        return usable_prefix_end(self.rules, input_len, -1, held), max_end

    # ---- maintenance ---------------------------------------------------------------------------
    def drain(self, abandon_prefetches: Callable[[float], int], timeout: float | None = None) -> StorageDrain:
        """Wait, for at most `timeout` (default: one call deadline) in all, for in-flight
        prefetches and then for queued L3 writes: flush_cache keeps L3 and should lose no
        write, but must answer. ``abandon_prefetches(deadline)`` is the prefetch owner's
        (``Scheduler.abandon_prefetches``): it waits for its reads until the deadline, drops
        them (their results are never applied) and says how many were still reading."""
        t0 = time.monotonic()
        deadline = t0 + (self.timeout_s if timeout is None else timeout)
        abandoned = abandon_prefetches(deadline)
        writes = self.client.drain(max(0.0, deadline - time.monotonic()))
        if abandoned or writes.pending:
            log.warning(
                "L3 drain stopped at its deadline: %d prefetches abandoned, %d writes still queued",
                abandoned,
                writes.pending,
            )
        return StorageDrain(abandoned, writes.written, writes.pending, time.monotonic() - t0)

    def clear(self, all_namespaces: bool = False) -> int:
        """Delete this namespace's L3 pages (every tenant), or every namespace's; only keys
        this project wrote (``StorageClient.clear``). Returns the keys deleted."""
        return self.client.clear(all_namespaces)

    def close(self, timeout: float | None = None) -> None:
        """Stop reading and close the client (its queued writes get up to `timeout`); the
        prefetch owner has dropped its tasks first (``Scheduler.close``)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close(timeout)

    def stats(self) -> Metrics:
        out = self.counters.copy().add(self.client.stats(), prefix="l3_")
        return out.add(self.client.health(), prefix="storage_")
