"""One request's grammar state, and the batch's token bitmasks.

A ``Constraint`` is a request's matcher, advanced over the tokens it has output so far (and
only those: a token is taken once the step that sampled it is read). Before a step samples a
constrained row, ``fill_masks`` writes the row's allowed tokens as a bitmask (bit ``t % 32``
of word ``t // 32``, llguidance's layout); the sampler masks everything else
(``runtime/sampler.py``).

Ends: once the grammar is complete its mask allows the EOS tokens (where more could
follow, those too) and the request stops on EOS as usual; when nothing can follow the
grammar (a closed JSON object), the request stops right after the last token, with
finish reason ``{"type": "stop", "matched": None}``. A dead end (the matcher in error:
no token of the vocabulary continues the output, or a token it did not allow was taken)
finishes the request with an abort naming the grammar, never a crash.
"""

from __future__ import annotations

import numpy as np

from hicache_jax import finish


class Constraint:
    def __init__(self, matcher):
        self.matcher = matcher
        self.dead: str | None = None  # why no token can continue (found when filling a mask)
        # A verify step's draft (speculative decoding): j -> why no token can continue after
        # the draft's first j tokens (``fill_draft_masks``), for this step only.
        self.draft_dead: dict[int, str] = {}

    def valid_draft(self, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the grammar allows from here, ending at a token
        that completes it (nothing may follow: the request would stop there). The matcher
        is left where it was."""
        draft = draft[: self.matcher.validate_tokens(draft)]
        taken = 0
        for token in draft:
            if not self.matcher.consume_token(token):
                break
            taken += 1
            if self.matcher.is_stopped():
                break
        self.matcher.rollback(taken)
        return draft[:taken]

    def accept(self, token: int) -> dict | None:
        """Take the sampled ``token``; a finish reason when the request ends here."""
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            return dead_end(self.matcher.get_error() or f"token {token} is not allowed")
        if self.matcher.is_stopped():  # complete, and nothing can follow: no EOS needed
            return finish.stop(None)
        return None


def dead_end(why: str) -> dict:
    return finish.abort(f"grammar dead end: {_first_line(why)}")


def fill_masks(rows: list[tuple[Constraint, int]], allowed: np.ndarray) -> None:
    """Write row ``r``'s allowed-token bitmask into ``allowed[r]`` ([S, W] int32) for each
    (constraint, r) in ``rows``, computed in parallel (llguidance's thread pool, outside the
    GIL). A row left with no token is marked ``dead``; its mask is then all-allowed (the
    token it samples is discarded: the request ends)."""
    if not rows:
        return
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(c.matcher, r) for c, r in rows], allowed)
    for c, r in rows:
        if c.matcher.is_error() or not allowed[r].any():
            c.dead = c.matcher.get_error() or "no token of the vocabulary continues the output"
            allowed[r] = -1


def fill_draft_masks(c: Constraint, draft: tuple[int, ...], row0: int, allowed: np.ndarray) -> None:
    """A drafted request's masks in a verify step: row ``row0 + j`` holds the tokens allowed
    after the draft's first j tokens (a draft from ``Constraint.valid_draft``), the matcher
    advanced over them and rolled back. A row with no token is marked as ``fill_masks``
    marks one: the request's ``dead`` for row ``row0``, ``draft_dead[j]`` past it (it ends
    the request only if the draft's first j tokens are accepted)."""
    import llguidance.numpy

    c.draft_dead = {}
    taken = 0
    try:
        for j in range(len(draft) + 1):
            if j:
                c.matcher.consume_token(draft[j - 1])
                taken += 1
            llguidance.numpy.fill_next_token_bitmask(c.matcher, allowed, row0 + j)
            if c.matcher.is_error() or not allowed[row0 + j].any():
                why = c.matcher.get_error() or "no token of the vocabulary continues the output"
                if j:
                    c.draft_dead[j] = why
                else:
                    c.dead = why
                allowed[row0 + j] = -1
    finally:
        c.matcher.rollback(taken)


_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else message
