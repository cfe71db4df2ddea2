"""How long a cached prefix may be: the one rule that matching and prefetching share.

A prefix may end at token ``e`` (a page boundary) only if everything the next token's
forward pass reads is there::

    tokens      0 ......................... e-1 | e (first recomputed token)
    full attn   every page before e
    sliding     pages holding e-W+1 .. e-1      (older pages may be gone)
    state       a state snapshot taken exactly at e

and it must leave work to do: ``e <= input_len - 1`` (the last prompt token is always
computed, it yields the first output's logits) and ``e <= logprob_start_len`` when input
logprobs are asked for (their logits must be computed). A hybrid takes every layer kind's
condition at once. ``e = 0`` is always valid.

Whoever asks "how far can this prompt be served from cache" -- the radix match, the L3
prefetch -- calls ``usable_prefix_end`` with what each tier holds; a prefetch that ended
anywhere else would bring pages the match then refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PrefixRules:
    page_size: int
    has_full: bool  # any full-attention layer
    sliding_window: int | None  # set when any layer is sliding
    has_state: bool

    def __post_init__(self):
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    def max_end(self, input_len: int, logprob_start_len: int = -1) -> int:
        """The cap before any cache is consulted: input_len - 1, logprob_start_len, floored
        to a page."""
        cap = input_len - 1
        if logprob_start_len is not None and logprob_start_len >= 0:
            cap = min(cap, logprob_start_len)
        return max(cap, 0) // self.page_size * self.page_size

    def swa_pages_needed(self, end: int) -> range:
        """Pages whose sliding-window KV the token at ``end`` reads."""
        if not self.sliding_window or end == 0:
            return range(0)
        first = max(0, end - self.sliding_window + 1) // self.page_size
        return range(first, (end - 1) // self.page_size + 1)


def usable_prefix_end(
    rules: PrefixRules,
    input_len: int,
    logprob_start_len: int,
    full: Sequence[bool],
    swa: Sequence[bool],
    state: Sequence[bool],
) -> int:
    """The longest valid prefix end, in tokens.

    ``full[j]``, ``swa[j]``: page ``j``'s full-attention / sliding KV is available;
    ``state[j]``: a state snapshot exists at the end of page ``j`` (token ``(j+1)P``).
    The sequences may be shorter than the prompt (only the pages some tier holds)."""
    P = rules.page_size
    n = rules.max_end(input_len, logprob_start_len) // P
    n = min(n, len(full) if rules.has_full else n, len(swa) if rules.sliding_window else n)
    if rules.has_full:  # every page before the end
        k = 0
        while k < n and full[k]:
            k += 1
        n = k
    if rules.has_state:
        n = min(n, len(state))
    for k in range(n, 0, -1):
        if rules.has_state and not state[k - 1]:
            continue
        if rules.sliding_window and not all(swa[j] for j in rules.swa_pages_needed(k * P)):
            continue
        return k * P
    return 0
