"""N-gram prompt lookup: draft the tokens that followed an earlier occurrence of the request's
last few tokens (SGLang's and vLLM's ``ngram`` speculative method). No model, no JAX.

The match, for a request whose tokens so far (prompt + accepted outputs) are ``t[0:L]``::

    t[0] ... t[e-n] ... t[e-1]  t[e] ... t[e+k-1] ... t[L-n] ... t[L-1]
             '-- the n-gram --' '-- the draft --'     '-- suffix n --'

``n`` is the longest length in ``[min_match, max_match]`` whose suffix ``t[L-n:L]`` also ends
at some ``e <= L-1``; of those ends, the latest. The draft is ``t[e:min(e+k, L)]``: it may
run into the suffix itself (in a loop of period ``p`` the latest earlier end is ``L-p``).

Latest, not earliest (vLLM's CPU proposer and TensorRT-LLM's ``is_use_oldest`` take the
earliest; SGLang's default ``BFS`` match type expands by recency): a short n-gram (SGLang's
default ``min_match`` is 1) recurs all over a long context, and the recent occurrence is the
one about the same names and the same text as what is being written now; the earliest is
often in the system prompt. For a long n-gram that occurs once the two agree. What latest
gives up: in a loop shorter than ``k`` the draft stops at the end of the tokens.

Each call costs O(new tokens * max_match + max_match**2 + k), not a scan of the history: one
dict per n-gram length maps the n-gram (by ``hash`` of its tuple, checked against the tokens
on a hit, so a hash collision can cost a draft but never yield a wrong one) to its latest end,
and a call indexes only the ends that are new since the last one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Which suffix lengths are looked up, longest first.

    The defaults are SGLang's (``--speculative-ngram-min-match-window-size 1``,
    ``--speculative-ngram-max-match-window-size 12``), whose flag names this project serves.
    vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max`` are both 5 when neither is given.
    """

    min_match: int = 1
    max_match: int = 12

    def __post_init__(self) -> None:
        for name in ("min_match", "max_match"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"NgramConfig.{name}={value!r}: must be an int")
        if self.min_match < 1:
            raise ValueError(f"NgramConfig.min_match={self.min_match}: must be >= 1")
        if self.max_match < self.min_match:
            raise ValueError(
                f"NgramConfig.max_match={self.max_match}: must be >= min_match ({self.min_match})"
            )


class NgramIndex:
    """One request's n-gram index, created empty; ``propose`` brings it up to date.

    ``propose`` expects the request's whole token list each time, grown since the last call.
    A list that does not extend the indexed one is indexed afresh: one that is shorter, or
    that differs within the first or the last ``max_match`` indexed tokens. Those are the
    tokens compared, so the check costs O(max_match); a list that agrees there but differs in
    between is taken as grown, and its drafts may come from the old tokens (a draft costs only
    acceptance when wrong: the target model verifies every one).
    """

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self._tokens: list[int] = []  # the indexed tokens, as ints
        # The lengths indexed: min_match - 1 too (``can_follow``), none shorter than 1.
        self._lo = max(1, config.min_match - 1)
        # _ends[n - _lo]: hash(tuple of n tokens) -> latest exclusive end of that n-gram,
        # over the ends indexed so far: 1 <= end < _next_end.
        self._ends: list[dict[int, int]] = [{} for _ in range(self._lo, config.max_match + 1)]
        self._next_end = 1

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram of ``tokens`` (``n`` in ``[min_match, max_match]``); [] if none or ``k <= 0``.

        Every call brings the index up to ``tokens``, ``k <= 0`` too: a caller can index a
        long prompt chunk by chunk as it is prefilled, rather than all at the first draft."""
        size = len(tokens)
        if not self._extended_by(tokens, size):
            self._reset()
        if size > len(self._tokens):
            self._tokens.extend(map(int, tokens[len(self._tokens) : size]))
        # Ends up to size - 1: an occurrence ending at size is the suffix itself.
        self._index(size)
        return self._lookup(k) if k > 0 else []

    def can_follow(self) -> bool:
        """Whether one more token, whichever, could give a draft (after ``propose`` brought
        the index up to the tokens). A suffix n-gram of ``t[0:L+1]`` that occurred before
        ends, one token earlier, in the last ``n - 1`` known tokens occurring before: so with
        ``min_match >= 2`` none can follow when the last ``min_match - 1`` tokens occur
        nowhere earlier. With ``min_match`` 1 any token seen before matches."""
        n, toks = self.config.min_match - 1, self._tokens
        if n == 0 or len(toks) <= n:
            return len(toks) >= 1 if n == 0 else False
        gram = tuple(toks[len(toks) - n :])
        end = self._ends[n - self._lo].get(hash(gram))
        return end is not None and tuple(toks[end - n : end]) == gram

    def _extended_by(self, tokens: Sequence[int], size: int) -> bool:
        indexed = len(self._tokens)
        if size < indexed:
            return False
        w = min(self.config.max_match, indexed)
        return (
            list(tokens[:w]) == self._tokens[:w]
            and list(tokens[indexed - w : indexed]) == self._tokens[indexed - w : indexed]
        )

    def _reset(self) -> None:
        self._tokens = []
        for table in self._ends:
            table.clear()
        self._next_end = 1

    def _index(self, stop: int) -> None:
        """Record every n-gram ending at ``end`` for ``_next_end <= end < stop``."""
        lo, hi = self._lo, self.config.max_match
        toks, ends = self._tokens, self._ends
        for end in range(self._next_end, stop):
            window = tuple(toks[max(0, end - hi) : end])  # the up-to-hi tokens before end
            m = len(window)
            for n in range(lo, min(hi, m) + 1):
                ends[n - lo][hash(window[m - n :])] = end
        self._next_end = max(self._next_end, stop)

    def _lookup(self, k: int) -> list[int]:
        lo, hi = self.config.min_match, self.config.max_match
        toks = self._tokens
        size = len(toks)
        suffix = tuple(toks[max(0, size - hi) :])
        m = len(suffix)
        for n in range(min(hi, m), lo - 1, -1):
            gram = suffix[m - n :]
            end = self._ends[n - self._lo].get(hash(gram))
            if end is not None and tuple(toks[end - n : end]) == gram:
                return toks[end : end + k]
        return []
