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
tasks and, each step, moves finished ones into the host tier (``poll``). Results are all
or nothing per prefix: after the reads, the end is recomputed over what actually arrived.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.cache.radix import Node
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.keys import Namespace, page_hashes, page_key

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
    applied: bool = False
    given_up: bool = False  # the request stopped waiting; the reads still land in L2


def prefetch_timeout(num_tokens: int) -> float:
    """How long the ``timeout`` policy waits: grows with the prompt (SGLang's rule)."""
    return min(30.0, 2.0 + 0.1 * num_tokens / 1024)


class StorageTier:
    def __init__(
        self,
        client: StorageClient,
        namespace: Namespace,
        cache: PrefixCache,
        *,
        policy: str = "timeout",
        threshold: int = 256,
        host_rate_limit: float = 0.5,
    ):
        self.client = client
        self.namespace = namespace
        self.cache = cache
        self.rules: PrefixRules = cache.rules
        self.kinds = [k for k in ("full", "swa", "mamba") if k in cache.host]
        self.policy = policy
        self.threshold = threshold
        self.host_rate_limit = host_rate_limit
        self.tasks: dict[str, PrefetchTask] = {}
        self._progress = threading.Event()  # set whenever a prefetch finishes
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="l3-plan")
        self.counters = {
            "prefetch_issued": 0,
            "prefetch_completed": 0,
            "prefetch_revoked": 0,
            "prefetch_timed_out": 0,
            "prefetch_below_threshold": 0,
            "prefetch_refused_host_full": 0,
            "prefetch_failed": 0,
            "prefetch_pages": 0,
            "l3_write_errors": 0,
        }
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
        items = [(page_key(h, SUFFIX[k]), self.cache.host[k].page(getattr(node, "host_" + k))) for k in kinds]
        fut = self.client.write_async(items, self.ns(salt))
        fut.add_done_callback(self._write_done)

    def _write_done(self, fut) -> None:
        if fut.exception() is not None:
            self.counters["l3_write_errors"] += 1
            log.warning("L3 write failed: %s", fut.exception())

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
        if self.prefetched_rows() >= self.host_rate_limit * sum(h.size for h in self.cache.host.values()):
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
            self.cache.availability(path),
            tree_end,
        )
        self.tasks[key] = task
        self.counters["prefetch_issued"] += 1
        self._pool.submit(self._run, task)

    def _run(self, task: PrefetchTask) -> None:
        try:
            self._plan_and_read(task)
        except Exception:  # an I/O failure is a miss, never a crash
            log.exception("L3 prefetch %s failed", task.key)
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
        found = self.client.store.exists([page_key(task.hashes[j], SUFFIX[k]) for k, j in probe])
        have = {kj: ok for kj, ok in zip(probe, found)}
        end = usable_prefix_end(
            self.rules, task.input_len, task.logprob_start_len, *self._flags(task, have, n)
        )
        if end <= task.tree_end:
            task.status = "below_threshold"  # L3 cannot extend the match
            return
        need = self._needed(task, end)
        handle = self.client.prefetch([page_key(task.hashes[j], SUFFIX[k]) for k, j in need], ns)
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

    def poll(self) -> None:
        """Move finished prefetches into the host tier (scheduler thread only)."""
        for key, task in list(self.tasks.items()):
            if task.status == "pending":
                continue
            del self.tasks[key]
            task.applied = True
            if task.status == "done":
                stored = self.cache.insert_host(
                    task.tokens, task.salt, task.data, task.hashes, task.end // self.rules.page_size
                )
                self.counters["prefetch_completed"] += 1
                self.counters["prefetch_pages"] += stored
            elif task.status == "below_threshold":
                self.counters["prefetch_below_threshold"] += 1
            else:
                self.counters["prefetch_failed"] += 1

    def ready(self, key: str) -> bool:
        """Whether the request may be scheduled now, by the prefetch policy
        (``best_effort``: at once; ``wait_complete``: when the reads are in;
        ``timeout``: when they are in or the prompt's timeout has passed)."""
        task = self.tasks.get(key)
        if task is None or task.given_up:
            return True
        if self.policy == "best_effort":
            return self._give_up(task, "prefetch_revoked")
        if self.policy == "timeout" and time.monotonic() - task.started > prefetch_timeout(task.input_len):
            return self._give_up(task, "prefetch_timed_out")
        return False

    def _give_up(self, task: PrefetchTask, counter: str) -> bool:
        self.counters[counter] += 1
        task.given_up = True
        return True

    def prefetched_rows(self) -> int:
        """Host rows holding prefetched data no request has used yet (the rate limit)."""
        return sum(
            sum(getattr(n, "host_" + k) is not None for k in self.kinds)
            for n in self.cache.nodes()
            if n.from_storage
        )

    # ---- maintenance ---------------------------------------------------------------------------
    def drain(self) -> None:
        """Finish in-flight prefetches (dropping their results) and queued L3 writes:
        flush_cache keeps L3 but must lose no write."""
        while any(t.status == "pending" for t in self.tasks.values()):
            time.sleep(0.005)
        self.tasks.clear()
        self.client.flush()

    def clear(self) -> None:
        self.client.flush()
        self.client.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()

    def stats(self) -> dict:
        out = dict(self.counters)
        out.update({f"l3_{k}": v for k, v in self.client.stats().items()})
        return out

    def pending(self) -> Sequence[PrefetchTask]:
        return [t for t in self.tasks.values() if t.status == "pending"]
