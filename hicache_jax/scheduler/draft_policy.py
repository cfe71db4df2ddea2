"""Whether a step drafts at all, and how much: drafting must pay for the verify step's
extra rows.

A verify step of ``B`` decoding requests runs ``S x w`` token rows (``S``: ``B`` rounded up
to a power of two, the decode step's row count; ``w`` the least of ``verify_widths(W)``,
2, 4, ..., ``W`` the speculative width, whose rows hold its ``B`` last tokens and its
drafts: ``runtime/batch_builder.py``), against the decode step's ``S``. So the choice is
per step and bucket, not per token: once a step verifies in ``S x w`` rows, every draft
token that fits them rides in rows already paid for.

Cost model: a step costs ``OVERHEAD_ROWS + rows`` (the fixed part: reading the weights,
dispatch; then each row's compute). The decode step yields ``B`` tokens; the verify step
``B + A``, ``A`` the draft tokens accepted. Verifying in ``S x w`` rows pays when
``(B + A) / (OVERHEAD_ROWS + S w) >= B / (OVERHEAD_ROWS + S)``, i.e. when::

    A >= needed(B, w) = B * S * (w - 1) / (OVERHEAD_ROWS + S)

On a memory-bound accelerator the overhead is hundreds of rows and ``needed`` is a fraction
of a token: any likely draft pays. On a few CPU cores it is tens: at ``B = 4``, ``w = 4``
``needed`` is 3 tokens, at ``w = 2`` one: a step whose only likely draft is one request's
verifies in 8 rows, not 16, and drops the drafts that do not fit them. The default, 12, is
SmolLM2-135M's on this project's 2-core CPU under load (``benchmarks/RESULTS.md``,
speculative section): a machine's constant, not a model's.

``worth_verifying`` picks the bucket: for each ``w`` it fills the ``S w - B`` draft rows
with the drafts of the requests due to probe first, then by acceptance rate (a draft cut
short keeps its first tokens), and takes the ``w`` whose expected tokens per cost,
``(B + A) / (OVERHEAD_ROWS + S w)``, is highest among those that pay or probe.

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
(``wont_verify``): no request would probe, and in every bucket even full drafts (``width -
1`` tokens each) at the highest rates, as many as fit, are expected to gain less than
``needed``. Such a step counts, for
each request, as a step with a draft and no verify step (``planned_ahead``), so a request
whose drafts stopped counting still probes every ``PROBE_EVERY`` steps: the step that
would probe is planned after N is read, with its draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hicache_jax.request import Req
from hicache_jax.scheduler.plan import verify_widths

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
    """Accepted draft tokens a verify step of ``batch`` requests in ``S x width`` token rows
    must yield to cost no more per token than their decode step (the module docstring's model)."""
    seqs = 1 << (batch - 1).bit_length()  # the decode step's rows (BatchBuilder's buckets)
    return batch * seqs * (width - 1) / (overhead_rows + seqs)


def _fill(
    order: list[tuple[Req, DraftHistory, int]], room: int, spread: bool
) -> tuple[dict[Req, int], float]:
    """Draft tokens kept per request, ``order``'s (request, history, draft length) filled in
    turn into ``room`` rows (``spread``: each request's first token before anyone's second),
    and their expected accepted tokens."""
    keep = {req: 0 for req, _, _ in order}
    for share in (1, None) if spread else (None,):
        for req, _, n in order:
            k = min(n - keep[req] if share is None else min(n, share), room)
            keep[req] += k
            room -= k
    return keep, sum(h.expected(keep[req]) for req, h, _ in order)


def _best(order, batch: int, width: int, overhead_rows: float) -> dict[Req, int]:
    """The bucket with the most expected tokens per cost among those that pay for their rows
    or probe: its draft tokens per request ({}: none). A step probes when a request due to
    probe has a draft; every request with a draft then gets at least its first token
    checked (a bucket has a row per request to spare), so probes stay aligned."""
    seqs = 1 << (batch - 1).bit_length()
    probe = any(h.probing for _, h, _ in order)
    best, value = {}, 0.0
    for w in verify_widths(width):
        keep, gain = _fill(order, seqs * w - batch, spread=probe)
        if probe or (gain > 0 and gain >= needed(batch, w, overhead_rows)):
            v = (batch + gain) / (overhead_rows + seqs * w)
            if v > value:
                best, value = keep, v
    return best


def _order(pairs: list[tuple[Req, DraftHistory, int]]) -> list[tuple[Req, DraftHistory, int]]:
    """Requests due to probe first, then by acceptance rate (stable among equals)."""
    return sorted((p for p in pairs if p[2] > 0), key=lambda p: (not p[1].probing, -p[1].rate))


def worth_verifying(
    drafts: dict[Req, list[int]], batch: int, width: int, overhead_rows: float = OVERHEAD_ROWS
) -> dict[Req, int]:
    """Whether a step of ``batch`` decoding requests should verify ``drafts`` (each request
    with its proposal; [] for none), and in which bucket: the draft tokens each request
    keeps (the first ones of its proposal), or {} for no verify step. Records each request's
    outcome either way."""
    hist = {req: history(req) for req in drafts}
    for req, h in hist.items():
        h.observe(req)
    keep = _best(_order([(req, h, len(drafts[req])) for req, h in hist.items()]), batch, width, overhead_rows)
    for req, h in hist.items():
        h.drafted = keep.get(req, 0)
        if drafts[req] and not h.drafted:
            h.idle += 1
    return keep


def wont_verify(
    reqs: list[Req],
    width: int,
    overhead_rows: float = OVERHEAD_ROWS,
    may_draft: Callable[[Req], bool] | None = None,
) -> bool:
    """Whether the next step of ``reqs`` (each decoding) would not verify whatever their
    drafts, by ``worth_verifying``'s rule: none would probe, and in no bucket would full
    drafts at the highest rates gain ``needed`` (an upper bound: a draft has at most
    ``width - 1`` tokens, and a bucket's rows filled by rate hold the most expected tokens
    any drafts could put there). ``may_draft(req)``: False only where no draft can follow
    the request's next token (the drafter proves it: ``NgramIndex.can_follow``); such a
    request neither probes nor gains. Reads the histories as the last step left them,
    changes nothing."""
    hist = [req.draft_history or DraftHistory() for req in reqs if may_draft is None or may_draft(req)]
    if any(h.probing for h in hist):
        return False
    return not _best(_order([(i, h, width - 1) for i, h in enumerate(hist)]), len(reqs), width, overhead_rows)


def planned_ahead(reqs: list[Req]) -> None:
    """Count a step planned before the last step's tokens were read (so without drafts; only
    where ``wont_verify``) as a step each of ``reqs`` had a draft and no verify step."""
    for req in reqs:
        history(req).idle += 1
