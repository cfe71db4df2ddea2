"""Speculative decoding's part of a plan: each decoding request's draft (``add_drafts``).

A drafter proposes tokens to follow a request's last one; the step then feeds the last token
and the draft together (a *verify step*), samples after every fed token, and the engine keeps
the draft's tokens while each equals what the request sampled at its position
(``Engine._results``). The request's sampling keys are per output position
(``runtime/sampler.py``), so what it samples after an accepted draft token is what it would
have sampled there without speculation: outputs are the same, greedy or not, and a draft only
decides how many tokens one step yields. For a drafter that proposes one token per position
(n-gram lookup), sampling and comparing is exactly rejection sampling against a point mass.

Which requests draft, and how much:

- only in a step where every request decodes (a verify step holds no prefill chunk: its
  programs sample every token row, which a long chunk would make costly);
- a request with repetition, frequency or presence penalties drafts: its row j is
  penalised with its counts plus draft tokens 1..j (``PenaltyInputs.draft_ids``), and its
  counts are written again from the tokens it accepted;
- a request with a grammar drafts what its grammar allows (``Constraint.valid_draft``: the
  draft is cut at the first token it refuses, and after one that completes it); its row j
  is masked with the grammar advanced over draft tokens 1..j (``fill_draft_masks``), and
  the matcher then advances over the accepted tokens only;
- at most ``width - 1`` tokens, none past ``max_new_tokens`` or the context length;
- with recurrent layers, none that reach the next page boundary: the state snapshot a page
  end needs is then taken by an ordinary decode step, and a verify step's states live only
  in its scratch slots (``ReqCache.trail``), one per draft token; likewise with DeepSeek
  V4's compressors, whose states go to scratch pages (``ReqCache.trail_pages``);
- only when the pages (and scratch slots) are free without retracting anyone: speculation
  never costs another request its place;
- only in a step whose drafts are expected to pay for the verify step's extra rows
  (``draft_policy``: from each request's acceptance so far);
- none in a step planned ahead of the step in flight (the overlap schedule): its requests'
  last tokens are not known yet (``Req.pending``). The engine plans ahead only a step that
  would not verify anyway (``draft_policy.wont_verify``), and each request counts it as a
  step without a verify step (``draft_policy.planned_ahead``).
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_jax.request import Req
from hicache_jax.scheduler.cache_adapter import CacheAdapter
from hicache_jax.scheduler.draft_policy import planned_ahead, worth_verifying
from hicache_jax.scheduler.plan import StepPlan

Propose = Callable[[Req, int], list[int]]  # (request, most tokens) -> its draft
Gate = Callable[[dict[Req, list[int]], int, int], bool]  # (drafts, batch, width) -> verify?


def draft_room(req: Req, *, width: int, context_len: int, page_size: int, recurrent: bool) -> int:
    """The most draft tokens ``req`` may feed after its last token in its next step (its last
    token known: not ``pending``)."""
    sp = req.sampling
    end = req.seq_len  # the step feeds the last token, at position end - 1
    room = min(width - 1, context_len - end - 1, sp.max_new_tokens - len(req.output_ids) - 1)
    if recurrent:  # stop short of the next page boundary (a boundary at ``end``: no draft)
        room = min(room, -(-end // page_size) * page_size - end - 1) if end % page_size else 0
    return max(room, 0)


def add_drafts(
    plan: StepPlan,
    adapter: CacheAdapter,
    propose: Propose,
    *,
    width: int,
    context_len: int,
    gate: Gate | None = worth_verifying,
) -> int:
    """Give each decode item of an all-decode ``plan`` its draft, where it has room and the
    pages are free (see the module docstring), if ``gate`` finds the drafts worth a verify
    step (``draft_policy``; None: always); returns the draft tokens added."""
    if not plan.items or not plan.decode_only:
        return 0
    drafts, ahead = [], []
    for item in plan.items:
        req = item.req
        if not item.samples:
            continue
        if req.pending:  # its last token is still in flight: nothing to draft after
            ahead.append(req)
            continue
        room = draft_room(
            req, width=width, context_len=context_len, page_size=adapter.P, recurrent=adapter.trails
        )
        draft = propose(req, room)[:room] if room else []
        if draft and req.grammar is not None:
            draft = req.grammar.valid_draft(draft)
        drafts.append((item, draft))
    planned_ahead(ahead)
    if not drafts:
        return 0
    if gate is not None and not gate({i.req: d for i, d in drafts}, len(plan.items), width):
        return 0
    added = 0
    for item, draft in drafts:
        req = item.req
        if not draft:
            continue
        end = item.end + len(draft)
        if not adapter.ensure_pages(req, end):
            continue
        if adapter.trails and adapter.trail_slots(req, len(draft)) is None:
            continue
        item.draft, item.trail, item.end = tuple(draft), tuple(req.cache.trail), end
        added += len(draft)
    return added
