"""How long a cached prefix may be: the one rule that matching and prefetching share.

A prefix may end at token ``e`` (a page boundary) only if everything the next token's
forward pass reads is there::

    tokens      0 ......................... e-1 | e (first recomputed token)
    EVERY       every page before e                 (full attention)
    WINDOW      pages holding e-W+1 .. e-1          (sliding window; older pages may be gone)
    SNAPSHOT    an entry taken exactly at e         (recurrent state)

and it must leave work to do: ``e <= input_len - 1`` (the last prompt token is always
computed, it yields the first output's logits) and ``e <= logprob_start_len`` when input
logprobs are asked for (their logits must be computed). A model takes the condition of
every cache kind it keeps at once, each by its ``Retention`` rule (``hicache_jax/kinds.py``):
the rules, not the kinds, are what this module knows. ``e = 0`` is always valid.

Whoever asks "how far can this prompt be served from cache" -- the radix match, the L3
prefetch -- calls ``usable_prefix_end`` with what each tier holds; a prefetch that ended
anywhere else would bring pages the match then refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hicache_jax.kinds import Retention, retention, with_retention


@dataclasses.dataclass(frozen=True)
class PrefixRules:
    page_size: int
    kinds: tuple[str, ...]  # the cache kinds the model keeps
    window: int | None = None  # tokens a WINDOW kind keeps behind a position (the token included)

    def __post_init__(self):
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.windowed and not self.window:
            raise ValueError(f"cache kinds {self.windowed} keep a window, but window={self.window}")
        if len(self.snapshot_kinds) > 1:
            raise ValueError(f"at most one snapshot kind, got {self.snapshot_kinds}")

    @property
    def every(self) -> tuple[str, ...]:
        """Kinds every page of a prefix needs."""
        return with_retention(self.kinds, Retention.EVERY)

    @property
    def windowed(self) -> tuple[str, ...]:
        """Kinds a prefix needs only inside the window behind its end."""
        return with_retention(self.kinds, Retention.WINDOW)

    @property
    def snapshot_kinds(self) -> tuple[str, ...]:
        return with_retention(self.kinds, Retention.SNAPSHOT)

    @property
    def snapshot(self) -> str | None:
        """The kind whose entry is taken at a prefix's end (None: the model keeps none)."""
        return self.snapshot_kinds[0] if self.snapshot_kinds else None

    @property
    def paged(self) -> tuple[str, ...]:
        """Kinds held one page per page of tokens."""
        return self.every + self.windowed

    def max_end(self, input_len: int, logprob_start_len: int = -1) -> int:
        """The cap before any cache is consulted: input_len - 1, logprob_start_len, floored
        to a page."""
        cap = input_len - 1
        if logprob_start_len is not None and logprob_start_len >= 0:
            cap = min(cap, logprob_start_len)
        return max(cap, 0) // self.page_size * self.page_size

    def window_pages(self, end: int) -> range:
        """Pages whose window-kind entries the token at ``end`` reads."""
        if not self.windowed or end == 0:
            return range(0)
        first = max(0, end - self.window + 1) // self.page_size
        return range(first, (end - 1) // self.page_size + 1)

    def pages_needed(self, kind: str, end: int) -> range:
        """The pages of ``kind`` a prefix ending at token ``end`` needs (for a snapshot
        kind: the page whose end is ``end``)."""
        rule = retention(kind)
        if rule is Retention.EVERY:
            return range(end // self.page_size)
        if rule is Retention.WINDOW:
            return self.window_pages(end)
        return range(end // self.page_size - 1, end // self.page_size) if end else range(0)


def usable_prefix_end(
    rules: PrefixRules, input_len: int, logprob_start_len: int, held: Mapping[str, Sequence[bool]]
) -> int:
    """The longest valid prefix end, in tokens.

    ``held[kind][j]``: page ``j``'s entry of a paged kind is available; for the snapshot
    kind, a snapshot exists at the end of page ``j`` (token ``(j+1)P``). The sequences may
    be shorter than the prompt (only the pages some tier holds)."""
    P = rules.page_size
    n = rules.max_end(input_len, logprob_start_len) // P
    for kind in rules.kinds:
        n = min(n, len(held[kind]))
    for kind in rules.every:  # every page before the end
        k = 0
        while k < n and held[kind][k]:
            k += 1
        n = k
    for k in range(n, 0, -1):
        if any(not held[kind][k - 1] for kind in rules.snapshot_kinds):
            continue
        if any(not all(held[kind][j] for j in rules.window_pages(k * P)) for kind in rules.windowed):
            continue
        return k * P
    return 0
