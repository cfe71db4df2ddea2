"""The most prompt tokens a prefix cache could have served: the theoretical maximum.

Definition (per request ``R`` with prompt ``p`` of ``n`` tokens; the maximum of a run is
the sum over its requests). ``R`` could have been served up to the largest ``e`` with

- ``p[:e]`` equal to the first ``e`` tokens of some *earlier* sequence ``S`` (``S`` is not
  ``R``): ``S`` is an earlier request's prompt followed by its generated tokens, because a
  finished request's whole sequence is cached; sequences of an earlier phase whose cache
  survives (L3 across a restart) count as earlier too;
- ``e`` a multiple of the page size, ``e <= n - 1`` (the last prompt token is always
  computed);
- ``e`` accepted by the engine's one rule, ``usable_prefix_end`` (``cache/prefix.py``),
  given what the cache keeps of the earlier sequences when its capacity is unlimited:
  every full-attention page; the sliding-window pages of ``S``'s prompt (each prefill
  chunk enters the tree) and of the window before ``S``'s end (decode drops the pages
  that slide out before the sequence enters the tree); Mamba state snapshots where the
  engine takes them (``scheduler.chunk_end``): at multiples of ``chunked_prefill_size``,
  at the prompt's last page boundary and at its end when page-aligned, and at the last
  page boundary of ``S`` (the one rolling decode snapshot).

*Earlier* means sent before ``R``'s prefix was matched. The server matches a prefix when it
admits a request, not when the request arrives, and admission need not follow arrival: a
request waiting for its L3 prefetch (``wait_complete``), held for a prefix that a running
request computes, or passed over by ``lpm`` lets later requests go first, and their pages
then serve it. The match comes before ``R``'s first token, so with timings (``prefilled``)
a sequence is earlier when it was sent before that; without them, when it was sent before
``R`` or less than ``reorder_s`` (50 ms) after it (requests sent that close together may
reach the server in either order). A sequence counts whole from its send, although the
engine can hit its prompt only once its chunks are done and its output once it has
finished, so under concurrent load the maximum is above what any order of admission can
reach. A Mamba prefill chunk that the step's token budget cuts short can leave one more
snapshot than the rule above counts, so on Mamba models under concurrent load the maximum
is the one for requests whose chunks run whole.

The maximum under the configured capacity replays the requests through an LRU cache of
``capacity_pages`` pages (leaf pages first, as the radix tree evicts), with the same rule.
With the run's timings (``prefilled``, ``done``) it replays them as they happened: a
request looks up just before its first token, its prompt enters the cache then and its
whole sequence when it finishes; without them, in the order they were sent, each whole at
once. It is an estimate: running requests' pages are not pinned and the sliding-window and
Mamba pools are not sized separately.

Sequences are cut into page-sized blocks and kept in a trie over blocks, so a run costs
O(total tokens).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from hicache_jax.cache.prefix import PrefixRules, usable_prefix_end
from hicache_jax.kinds import Retention, retention

SEEN_BEFORE = -1  # the id of sequences from an earlier phase
REORDER_S = 0.05  # sends closer than this may reach the server in either order


@dataclasses.dataclass(frozen=True)
class SeqRecord:
    """One request as the theoretical maximum sees it (``sent``: seconds, any origin)."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    sent: float = 0.0
    prefilled: float | None = None  # its first token (the prompt is in the cache)
    done: float | None = None  # its last token (the whole sequence is)


def snapshot_pages(rules: PrefixRules, prompt_len: int, total_len: int, chunk: int) -> set[int]:
    """Pages ``j`` whose end (token ``(j+1)P``) gets a Mamba snapshot (see the docstring)."""
    P = rules.page_size
    ends = set(range(chunk, prompt_len + 1, chunk))
    ends.add((prompt_len - 1) // P * P)
    ends.add(prompt_len)
    ends.add(total_len // P * P)
    return {e // P - 1 for e in ends if e > 0 and e % P == 0}


def swa_kept(rules: PrefixRules, prompt_len: int, total_len: int, j: int) -> bool:
    """Whether page ``j`` of a finished sequence keeps its sliding-window KV."""
    end = total_len // rules.page_size * rules.page_size
    return j <= prompt_len // rules.page_size or j >= rules.window_pages(end).start


def _add(providers: tuple[int, ...], rid: int) -> tuple[int, ...]:
    """Up to two distinct providers: enough to know whether one is not the asker."""
    return providers if rid in providers or len(providers) >= 2 else providers + (rid,)


def _other(providers: tuple[int, ...], rid: int) -> bool:
    return any(p != rid for p in providers)


class _Node:
    __slots__ = ("children", "parent", "key", "seen", "swa", "state")

    def __init__(self, parent: _Node | None, key: tuple[int, ...] | None):
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent, self.key = parent, key
        self.seen: tuple[int, ...] = ()
        self.swa: tuple[int, ...] = ()
        self.state: tuple[int, ...] = ()


class BlockTrie:
    """Sequences cut into pages; each page remembers which sequences hold it and which
    of them keep its sliding-window KV and a Mamba snapshot at its end."""

    def __init__(self, rules: PrefixRules, chunk: int, capacity_pages: int | None = None):
        self.rules, self.chunk, self.capacity = rules, chunk, capacity_pages
        self.root = _Node(None, None)
        self.lru: OrderedDict[_Node, None] = OrderedDict()  # parents after their children

    def _key(self, seq: Sequence[int], j: int) -> tuple[int, ...]:
        P = self.rules.page_size
        return tuple(seq[j * P : (j + 1) * P])

    def insert(self, rec: SeqRecord, rid: int) -> None:
        seq = rec.prompt + rec.output
        n, total = len(rec.prompt), len(seq)
        snaps = snapshot_pages(self.rules, n, total, self.chunk) if self.rules.snapshot else set()
        node, path = self.root, []
        for j in range(total // self.rules.page_size):
            key = self._key(seq, j)
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key)
            child.seen = _add(child.seen, rid)
            if self.rules.windowed and swa_kept(self.rules, n, total, j):
                child.swa = _add(child.swa, rid)
            if j in snaps:
                child.state = _add(child.state, rid)
            node = child
            path.append(child)
        self._touch(path)
        self._evict()

    def query(self, prompt: Sequence[int], rid: int, touch: bool = False) -> int:
        """The longest usable cached prefix of ``prompt`` among sequences other than ``rid``."""
        n = len(prompt)
        node, path = self.root, []
        for j in range(self.rules.max_end(n) // self.rules.page_size):
            child = node.children.get(self._key(prompt, j))
            if child is None or not _other(child.seen, rid):
                break
            node = child
            path.append(child)
        by_rule = {
            Retention.EVERY: [True] * len(path),
            Retention.WINDOW: [_other(c.swa, rid) for c in path],
            Retention.SNAPSHOT: [_other(c.state, rid) for c in path],
        }
        held = {k: by_rule[retention(k)] for k in self.rules.kinds}
        end = usable_prefix_end(self.rules, n, -1, held)
        if touch:
            self._touch(path[: end // self.rules.page_size])
        return end

    def _touch(self, path: list[_Node]) -> None:
        if self.capacity is None:
            return
        for node in reversed(path):  # deepest first: a parent stays behind its children
            self.lru[node] = None
            self.lru.move_to_end(node)

    def _evict(self) -> None:
        if self.capacity is None:
            return
        while len(self.lru) > self.capacity:
            leaf, _ = self.lru.popitem(last=False)  # least recent; never has a child left
            del leaf.parent.children[leaf.key]


def matched_by(rec: SeqRecord, reorder_s: float = REORDER_S) -> float:
    """A time by which ``rec``'s prefix had been matched: its first token, else its send
    plus ``reorder_s``."""
    return rec.prefilled if rec.prefilled is not None else rec.sent + reorder_s


def theoretical_max(
    records: Sequence[SeqRecord],
    rules: PrefixRules,
    chunk: int,
    seen: Sequence[SeqRecord] = (),
    reorder_s: float = REORDER_S,
) -> list[int]:
    """Per request, the longest prefix it could have been served from cache (unlimited
    capacity; ``seen``: sequences of an earlier phase, visible to every request)."""
    trie = BlockTrie(rules, chunk)
    for s in seen:
        trie.insert(s, SEEN_BEFORE)
    # At equal times a send goes first: a maximum may only err upwards.
    events = sorted(
        [(r.sent, 0, i) for i, r in enumerate(records)]
        + [(matched_by(r, reorder_s), 1, i) for i, r in enumerate(records)]
    )
    out = [0] * len(records)
    for _, is_query, i in events:
        if is_query:
            out[i] = trie.query(records[i].prompt, i)
        else:
            trie.insert(records[i], i)
    return out


def capacity_max(
    records: Sequence[SeqRecord],
    rules: PrefixRules,
    chunk: int,
    capacity_pages: int | None,
    seen: Sequence[SeqRecord] = (),
) -> list[int]:
    """Per request, the longest prefix an LRU cache of ``capacity_pages`` pages (None:
    unlimited) could have served, requests taken in the order they were sent."""
    if capacity_pages is not None and capacity_pages <= 0:
        return [0] * len(records)
    trie = BlockTrie(rules, chunk, capacity_pages)
    for s in seen:
        trie.insert(s, SEEN_BEFORE)
    out = [0] * len(records)
    if records and all(r.prefilled is not None and r.done is not None for r in records):
        # (time, order at equal times: look-ups first, then prompts, then whole sequences)
        events = [(r.prefilled, 0, i) for i, r in enumerate(records)]
        events += [(r.prefilled, 1, i) for i, r in enumerate(records)]
        events += [(r.done, 2, i) for i, r in enumerate(records)]
        for _, what, i in sorted(events):
            r = records[i]
            if what == 0:
                out[i] = trie.query(r.prompt, i, touch=True)
            else:
                trie.insert(r if what == 2 else SeqRecord(r.prompt, ()), i)
        return out
    for i in sorted(range(len(records)), key=lambda i: records[i].sent):
        out[i] = trie.query(records[i].prompt, i, touch=True)
        trie.insert(records[i], i)
    return out
