"""Whether a step drafts at all: drafting must pay for the verify step's extra rows.

A verify step of ``B`` decoding requests runs ``S x W`` token rows (``S``: ``B`` rounded up
to a power of two, the decode step's row count; ``W``: the speculative width), however few
draft tokens it carries (``runtime/batch_builder.py``), against the decode step's ``S``. So
the choice is per step, not per token: once a step verifies, every request's draft rides
in rows already paid for, and each drafts all it has room for (``drafts.add_drafts``).

Cost model: a step costs ``OVERHEAD_ROWS + rows`` (the fixed part: reading the weights,
dispatch; then each row's compute). The decode step yields ``B`` tokens; the verify step
``B + A``, ``A`` the draft tokens accepted. Verifying pays when
``(B + A) / (OVERHEAD_ROWS + S W) >= B / (OVERHEAD_ROWS + S)``, i.e. when::

    A >= needed(B, W) = B * S * (W - 1) / (OVERHEAD_ROWS + S)

On a memory-bound accelerator the overhead is hundreds of rows and ``needed`` is a fraction
of a token: any likely draft pays. On a few CPU cores it is tens: at ``B = 4``, ``W = 4``
``needed`` is several tokens, so a step verifies only when most requests have drafts that
are usually right. The default, 12, is SmolLM2-135M's on this project's 2-core CPU under
load (``benchmarks/RESULTS.md``, speculative section): a machine's constant, not a model's.

``A`` is estimated per request from its own history (``DraftHistory``, kept on the
request): ``rate * len(draft)``, ``rate`` the fraction of its draft tokens accepted, an
exponential average over its verify steps (weight ``RECENT`` on the latest), starting at
``PRIOR``. A request whose drafts are rejected thus stops counting; so that it can
recover (a request that starts quoting its prompt), one that had a draft in
``PROBE_EVERY`` steps in a row without a verify step makes the next step with its draft
verify: a probe, whose outcome enters its rate as any other. A new request probes at its
first draft: nothing is known of it yet. Probes align: every request that drafted in a verify step
counts from it, so a batch whose drafts all fail probes about once per ``PROBE_EVERY + 1``
steps, which costs at most ``1 / (PROBE_EVERY + 1)`` of the verify step's extra rows.

The histories learn from the engine's counters (``Req.spec_verifications``,
``Req.spec_accepted_tokens``): the next call sees what the last planned draft earned.
Nothing here reads a clock: every process of a multi-host engine decides the same.

The overlap schedule plans step N+1 while step N runs (``Engine._can_run_ahead``), before
N's tokens are read; no draft can follow a token not known yet, so a step planned ahead has
none. It is planned ahead only when it would not verify whatever its drafts were
(``wont_verify``): no request would probe, and even full drafts (``width - 1`` tokens each)
at every request's rate are expected to gain less than ``needed``. Such a step counts, for
each request, as a step with a draft and no verify step (``planned_ahead``), so a request
whose drafts stopped counting still probes every ``PROBE_EVERY`` steps: the step that
would probe is planned after N is read, with its draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hicache_jax.request import Req

OVERHEAD_ROWS = 12.0  # a step's fixed cost, in token rows, on CPU (see the module docstring)
# On an accelerator: the rows at which a bfloat16 step's compute (2 FLOPs per weight per row)
# matches reading its weights (2 bytes each): TPU v5e's 197 TFLOP/s over 819 GB/s.
ACCELERATOR_OVERHEAD_ROWS = 240.0
PRIOR = 1.0  # the acceptance rate assumed of a request with no verify step yet
RECENT = 0.5  # the weight of the latest verify step in a request's acceptance rate
PROBE_EVERY = 16  # steps with a draft and no verify step before a request counts at PRIOR


@dataclasses.dataclass
class DraftHistory:
    """One request's acceptance record (``Req.draft_history``)."""

    rate: float = PRIOR  # accepted / drafted, averaged over its verify steps
    idle: int = PROBE_EVERY  # steps in a row it had a draft and no verify step (new: probes)
    verifications: int = 0  # ``Req.spec_verifications`` when last seen
    accepted: int = 0  # ``Req.spec_accepted_tokens`` when last seen
    drafted: int = 0  # the draft tokens it was last given

    def observe(self, req: Req) -> None:
        """Take in what its last draft earned, if a verify step has run it since."""
        if req.spec_verifications > self.verifications and self.drafted:
            got = (req.spec_accepted_tokens - self.accepted) / self.drafted
            self.rate += RECENT * (min(got, 1.0) - self.rate)
            self.idle = 0
        self.verifications, self.accepted = req.spec_verifications, req.spec_accepted_tokens

    @property
    def probing(self) -> bool:
        return self.idle >= PROBE_EVERY

    def expected(self, n: int) -> float:
        """Draft tokens of an ``n``-token draft it expects accepted."""
        return n * self.rate


def history(req: Req) -> DraftHistory:
    if req.draft_history is None:
        req.draft_history = DraftHistory()
    return req.draft_history


def needed(batch: int, width: int, overhead_rows: float = OVERHEAD_ROWS) -> float:
    """Accepted draft tokens a verify step of ``batch`` requests must yield to cost no more
    per token than their decode step (the module docstring's model)."""
    seqs = 1 << (batch - 1).bit_length()  # the decode step's rows (BatchBuilder's buckets)
    return batch * seqs * (width - 1) / (overhead_rows + seqs)


def worth_verifying(
    drafts: dict[Req, list[int]], batch: int, width: int, overhead_rows: float = OVERHEAD_ROWS
) -> bool:
    """Whether a step of ``batch`` decoding requests should verify ``drafts`` (each request
    with its proposal; [] for none); records each request's outcome either way."""
    hist = {req: history(req) for req in drafts}
    for req, h in hist.items():
        h.observe(req)
    gain = sum(h.expected(len(drafts[req])) for req, h in hist.items())
    probe = any(h.probing and drafts[req] for req, h in hist.items())
    verify = probe or (gain > 0 and gain >= needed(batch, width, overhead_rows))
    for req, h in hist.items():
        h.drafted = len(drafts[req]) if verify else 0
        if drafts[req] and not verify:
            h.idle += 1
    return verify


def wont_verify(
    reqs: list[Req],
    width: int,
    overhead_rows: float = OVERHEAD_ROWS,
    may_draft: Callable[[Req], bool] | None = None,
) -> bool:
    """Whether the next step of ``reqs`` (each decoding) would not verify whatever their
    drafts, by ``worth_verifying``'s rule: none would probe, and full drafts at their rates
    are expected to gain less than ``needed`` (an upper bound: a draft has at most
    ``width - 1`` tokens). ``may_draft(req)``: False only where no draft can follow the
    request's next token (the drafter proves it: ``NgramIndex.can_follow``); such a request
    neither probes nor gains. Reads the histories as the last step left them, changes nothing."""
    hist = [req.draft_history or DraftHistory() for req in reqs if may_draft is None or may_draft(req)]
    if any(h.probing for h in hist):
        return False
    gain = sum(h.expected(width - 1) for h in hist)
    return gain == 0 or gain < needed(len(reqs), width, overhead_rows)


def planned_ahead(reqs: list[Req]) -> None:
    """Count a step planned before the last step's tokens were read (so without drafts; only
    where ``wont_verify``) as a step each of ``reqs`` had a draft and no verify step."""
    for req in reqs:
        history(req).idle += 1
