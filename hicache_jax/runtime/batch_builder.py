"""The padded device inputs of a step, built from its plan (``hicache_jax/scheduler/plan.py``).

Shapes come from a few buckets so steady-state serving never recompiles:

- decode-only steps: ``S`` = the next power of two >= the number of sequences, ``T = S``;
- steps with prefill: ``T`` from a short geometric list, ``S = max_running_requests``;
- logits rows: one per sequence, or one per token when a request wants input logprobs;
- verify steps (speculative decoding: a request feeds its last token and a draft, every
  item a decode): ``S`` as for decode-only steps, ``T = S * spec_width`` (room for every
  request's whole draft), and every token row is a logits row and samples
  (``StepShape.N = R = T``), each with its request's settings and the key of the output
  position it predicts, so the token after an accepted draft is the token the request
  would have sampled there without one;
- top logprobs: none, or ``MAX_TOP_LOGPROBS`` when a request wants any;
- grammar bitmasks: always ``[N, ceil(V / 32)]``, a row per sampled row (all ones for
  unconstrained rows), so a constrained row never changes the program.

``warmup_programs`` lists every combination, so warm-up can compile them all.

A row whose packing raises (a value the arrays cannot hold, a grammar whose mask cannot be
computed) raises ``RowFailed`` naming its request and, where known, the field: nothing has
touched the device yet, so the engine fails that request alone and builds the step again
without it.
"""

from __future__ import annotations

import numpy as np

from hicache_jax.grammar.constraint import fill_draft_masks, fill_masks
from hicache_jax.models.batch import ForwardBatch
from hicache_jax.request import Req
from hicache_jax.runtime.penalties import PenaltyInputs, held_back
from hicache_jax.runtime.sampler import SamplingInputs
from hicache_jax.runtime.step_inputs import DraftInputs, StateCopies, StepInputs, StepShape
from hicache_jax.sampling_params import GRAMMARS
from hicache_jax.scheduler.plan import TOP_WIDTHS, StepPlan, token_buckets

# The sampling settings packed per row: (SamplingParams field, ``SamplingInputs`` array).
SAMPLED = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"))
# The penalty settings packed per row: (SamplingParams field, ``PenaltyInputs`` array).
PENALISED = (
    ("repetition_penalty", "repetition"),
    ("frequency_penalty", "frequency"),
    ("presence_penalty", "presence"),
    ("min_new_tokens", "min_new_tokens"),
)


class RowFailed(Exception):
    """Packing one request's row of a step raised; ``field``: the sampling setting being
    packed (a ``SamplingParams`` field), or None."""

    def __init__(self, req: Req, field: str | None, cause: BaseException):
        self.req, self.field, self.cause = req, field, cause
        where = f"sampling_params.{field}: " if field else ""
        super().__init__(f"{where}cannot be packed into the step ({type(cause).__name__}: {cause})")


class BatchBuilder:
    def __init__(
        self,
        *,
        page_size: int,
        groups: tuple[str, ...],
        max_running: int,
        max_prefill: int,
        max_pages: int,
        vocab_size: int,
        spec_width: int = 0,
        eos_token_ids=(),
        draft_groups: tuple[str, ...] = (),
    ):
        """``spec_width``: the most tokens a request feeds in a verify step (its last token
        and its draft; 0: no speculative decoding). ``eos_token_ids``: what
        ``min_new_tokens`` holds back (``penalties.held_back``). ``draft_groups``: the page
        groups of a multi-token-prediction block that drafts in every step (none: no such
        drafts; ``StepInputs.draft``)."""
        self.P = page_size
        self.mask_words = -(-vocab_size // 32)  # a row's grammar bitmask (``hicache_jax/grammar``)
        self._masks: dict[int, np.ndarray] = {}
        self.groups = groups
        self.max_running = max_running
        self.buckets = token_buckets(max_prefill + max_running)
        self.spec_width = spec_width
        self.max_pages = max_pages
        self.max_seqs = self.max_seqs_for(max_running)
        self.eos_token_ids = tuple(eos_token_ids)
        self.draft_groups = tuple(draft_groups)

    @staticmethod
    def max_seqs_for(max_running: int) -> int:
        """The most sequences any step holds (decode buckets round up to a power of two)."""
        return max(max_running, 1 << (max_running - 1).bit_length())

    def shapes(self, plan: StepPlan) -> StepShape:
        """The step shape of a plan."""
        if plan.verify:  # every token row samples: the token after each draft token
            S = self._decode_seqs(len(plan.items))
            return StepShape(S * self.spec_width, S, S * self.spec_width, False, S * self.spec_width)
        if plan.decode_only:
            S = self._decode_seqs(len(plan.items))
            T = S
        else:
            S = self.max_running
            T = next(b for b in self.buckets if b >= plan.num_tokens)
        R = T if any(i.wants_input_logprobs for i in plan.items) else S
        return StepShape(T, S, R, plan.decode_only)

    @staticmethod
    def _decode_seqs(n: int) -> int:
        return 1 << (n - 1).bit_length()

    def warmup_shapes(self) -> list[StepShape]:
        """Every shape ``shapes`` can return (R = T: input logprobs; N = T: verify)."""
        decode = sorted({self._decode_seqs(n) for n in range(1, self.max_running + 1)})
        out = [StepShape(S, S, S, True) for S in decode]
        for T in self.buckets:
            out += [StepShape(T, self.max_running, R, False) for R in sorted({self.max_running, T})]
        if self.spec_width > 1:
            out += [
                StepShape(S * self.spec_width, S, S * self.spec_width, False, S * self.spec_width)
                for S in decode
            ]
        return out

    def warmup_programs(self) -> list[tuple[StepShape, int]]:
        """Every (shape, top-logprobs width) a step can run with."""
        return [(shape, top) for shape in self.warmup_shapes() for top in TOP_WIDTHS]

    def build(
        self,
        plan: StepPlan,
        shape: StepShape | None = None,
        feed_from: dict[Req, int] | None = None,
        loads=None,
    ) -> StepInputs:
        """The step's device inputs (``StepInputs``). ``shape`` forces one (warm-up builds
        empty batches of each). ``feed_from``: requests whose next input token is still on
        the device, sampled by the step in flight at the given row (``ForwardBatch.feed_rows``).
        ``loads``: L2 pages the step writes layer by layer (``ForwardBatch.loads``)."""
        shape = StepShape(*shape) if shape else self.shapes(plan)
        T, S, R, decode_only = shape[:4]
        N = shape.sample_rows
        verify = shape.verify
        P = self.P
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        cu = np.zeros(S + 1, np.int32)
        kv = np.zeros(S, np.int32)
        tables = {g: np.zeros((S, self.max_pages), np.int32) for g in self.groups}
        slots = {g: np.full(T, -1, np.int32) for g in self.groups}
        state_slots = np.full(S, -1, np.int32)
        has_init = np.zeros(S, bool)
        feed = np.full(T, -1, np.int32)
        trail = np.full((S, self.spec_width), -1, np.int32) if verify else None
        targets = np.full(R, -1, np.int32)
        s_inputs = {
            "temperature": np.zeros(N, np.float32),
            "top_p": np.ones(N, np.float32),
            "top_k": np.full(N, -1, np.int32),
            "min_p": np.zeros(N, np.float32),
            "seeds": np.zeros(N, np.uint32),
            "counters": np.zeros(N, np.int32),
        }
        last_rows = np.arange(N, dtype=np.int32) if verify else np.zeros(N, np.int32)
        constrained = np.zeros(N, bool)
        penalty = PenaltyInputs.neutral(N, self.spec_width - 1 if verify else 0)
        grammar_rows = []
        drafting = _DraftRows(T, S) if self.draft_groups else None
        first_rows, sample_rows = [], []
        t = 0
        for s, item in enumerate(plan.items):
            r = item.req
            n = item.num_tokens
            # The rows sampling this item's tokens: one per fed token in a verify step, else
            # the sequence's own row (a chunk that does not end the sequence samples nothing
            # the engine reads).
            row0 = t if verify else s
            rows = range(row0, row0 + n) if verify else range(s, s + 1)
            field = None  # the sampling setting being packed, for RowFailed
            try:
                fill = item.fed_ids
                ids[t : t + n] = fill
                if r.pending:  # the last token fed is still on the device
                    feed[t + n - 1 - len(item.draft)] = feed_from[r]
                p = np.arange(item.start, item.end)
                pos[t : t + n] = p
                for g, pages in r.cache.pages.items():
                    if g in tables:
                        row = np.array([-1 if x is None else x for x in pages], np.int64)
                        tables[g][s, : len(row)] = np.maximum(row, 0)
                        slot_page = row[p // P]
                        if (slot_page < 0).any():
                            raise RuntimeError(f"request {r.rid}: no {g} page for positions being written")
                        slots[g][t : t + n] = slot_page * P + p % P
                for g, scratch in r.cache.trail_pages.items():  # a verify step's, per fed token
                    if g in slots and len(scratch) == n - 1:  # but the last: a scratch page's row
                        slots[g][t : t + n - 1] = np.asarray(scratch) * P + p[:-1] % P
                kv[s] = item.end
                state_slots[s] = -1 if r.cache.state_slot is None else r.cache.state_slot
                has_init[s] = item.has_initial_state
                if trail is not None:
                    trail[s, : len(item.trail)] = item.trail
                sp = r.sampling
                for j, q in enumerate(rows):
                    for field, key in SAMPLED:
                        s_inputs[key][q] = getattr(sp, field)
                    field = "seed"
                    s_inputs["seeds"][q] = r.seed
                    field = None
                    s_inputs["counters"][q] = len(r.output_ids) + r.pending + j
                if r.grammar is not None and item.samples:
                    constrained[row0 : row0 + (n if verify else 1)] = True
                    grammar_rows.append((r.grammar, row0, item.draft))
                if not verify:
                    last_rows[s] = (t + n - 1) if R == T else s
                if R == T and not (verify and item.samples):  # a verify step's prompt chunk too
                    nxt = fill[1:] + r.fill_ids[item.end : item.end + 1]  # row q scores token q+1
                    targets[t : t + len(nxt)] = nxt
                _pack_penalty(penalty, item, rows, self.eos_token_ids)
                if drafting is not None:
                    drafting.add(item, s, t, verify, self._draft_cap(r))
            except RowFailed:
                raise
            except Exception as e:
                raise RowFailed(r, field, e) from e
            first_rows.append(t)
            sample_rows.append(row0 if item.samples else -1)
            t += n
            cu[s + 1] = t
        cu[len(plan.items) + 1 :] = t
        logits_rows = (
            np.arange(R, dtype=np.int32) if R == T else np.minimum(cu[1:] - 1, T - 1).astype(np.int32)
        )
        if R != T:
            logits_rows[len(plan.items) :] = 0
        batch = ForwardBatch(
            input_ids=ids,
            positions=pos,
            cu_q_lens=cu,
            kv_lens=kv,
            num_seqs=np.int32(len(plan.items)),
            page_tables=tables,
            slot_mappings=slots,
            state_slots=state_slots,
            has_initial_state=has_init,
            logits_indices=logits_rows,
            feed_rows=feed,
            loads=loads,
            state_trail=trail,
            decode_only=decode_only,
        )
        allowed = self._all_allowed(N)
        if grammar_rows:
            allowed = allowed.copy()
            _fill_masks([(g, q) for g, q, draft in grammar_rows if not draft], allowed, plan)
            for g, q, draft in grammar_rows:
                if draft:
                    try:
                        fill_draft_masks(g, draft, q, allowed)
                    except Exception as e:
                        req = next(i.req for i in plan.items if i.req.grammar is g)
                        raise RowFailed(req, _grammar_field(req), e) from e
        sampling = SamplingInputs(
            last_rows=last_rows, targets=targets, allowed=allowed, constrained=constrained, **s_inputs
        )
        wants_top = any(i.req.return_logprob and i.req.top_logprobs_num for i in plan.items)
        return StepInputs(
            shape=shape,
            batch=batch,
            sampling=sampling,
            copies=self._copies(plan),
            penalty=penalty,
            top_logprobs=TOP_WIDTHS[wants_top],
            first_rows=tuple(first_rows),
            sample_rows=tuple(sample_rows),
            draft=None if drafting is None else drafting.inputs(),
        )

    def _draft_cap(self, req: Req) -> int:
        """Positions ``req`` holds pages for in every drafting group."""
        pages = req.cache.pages
        return min(len(pages.get(g, ())) for g in self.draft_groups) * self.P

    def _all_allowed(self, S: int) -> np.ndarray:
        """[S, W] int32 bitmask allowing every token, kept per S (read-only: copy to fill)."""
        if S not in self._masks:
            mask = np.full((S, self.mask_words), -1, np.int32)
            mask.flags.writeable = False
            self._masks[S] = mask
        return self._masks[S]

    def _copies(self, plan: StepPlan) -> StateCopies:
        K = self.max_running

        def pad(pairs):
            src = np.full(K, -1, np.int32)
            dst = np.full(K, -1, np.int32)
            for i, (a, b) in enumerate(pairs):
                src[i], dst[i] = a, b
            return src, dst

        bs, bd = pad(plan.copies_before)
        as_, ad = pad(plan.copies_after)
        return StateCopies(before_src=bs, before_dst=bd, after_src=as_, after_dst=ad)


class _DraftRows:
    """A step's ``DraftInputs``, item by item."""

    def __init__(self, T: int, S: int):
        self.next_ids = np.zeros(T, np.int32)
        self.next_rows = np.full(T, -1, np.int32)
        self.draft_rows = np.zeros(S, np.int32)
        self.draft_lens = np.zeros(S, np.int32)
        self.draft_caps = np.zeros(S, np.int32)

    def add(self, item, s: int, t: int, verify: bool, cap: int) -> None:
        """Item ``s``, whose token rows start at ``t``: the token after each row is the
        prompt's next (a chunk's last row: the next chunk's first token) or the one sampled
        after it (each row of a sampling item in a verify step; the last row of a sampling
        item, at row ``s``). A verify step may hold a one-token chunk that does not end its
        prompt (``decode_only``): its row samples too, but the token after it is the prompt's."""
        n, fed = item.num_tokens, item.fed_ids
        if verify and item.samples:
            self.next_rows[t : t + n] = np.arange(t, t + n)
        else:
            self.next_ids[t : t + n - 1] = fed[1:]
            if item.samples:
                self.next_rows[t + n - 1] = s
            elif item.end < len(item.req.fill_ids):
                self.next_ids[t + n - 1] = item.req.fill_ids[item.end]
        self.draft_rows[s] = t if verify else t + n - 1
        self.draft_lens[s] = len(item.draft)
        self.draft_caps[s] = cap

    def inputs(self) -> DraftInputs:
        return DraftInputs(self.next_ids, self.next_rows, self.draft_rows, self.draft_lens, self.draft_caps)


def _pack_penalty(out: PenaltyInputs, item, rows: range, eos_token_ids) -> None:
    """An item's penalty inputs on its sampled ``rows``. Only rows that sample the request's
    next tokens name the request's slot: a chunk that does not end the request's sequence
    adds nothing to its counts. A drafted request's row j counts draft tokens 1..j on top
    of the slot's counts, and adds nothing to them (the engine writes its slot's row from
    the tokens it accepted)."""
    r, sp = item.req, item.req.sampling
    field = None
    try:
        for j, q in enumerate(rows):
            if item.samples and r.penalty_slot is not None:
                out.slots[q] = r.penalty_slot
            if item.draft:
                out.draft_ids[q, :j] = item.draft[:j]
                out.counts_sample[q] = False
            for field, key in PENALISED:
                getattr(out, key)[q] = getattr(sp, field)
            if sp.min_new_tokens:
                field = "stop_token_ids"
                ids = held_back(sp, eos_token_ids)
                out.stop_ids[q, : len(ids)] = ids
    except Exception as e:
        raise RowFailed(r, field, e) from e


def _fill_masks(rows: list, allowed: np.ndarray, plan: StepPlan) -> None:
    """``fill_masks`` for the step's constrained rows; when it raises, the rows are filled one
    at a time to find the one at fault (``RowFailed``)."""
    try:
        fill_masks(rows, allowed)
    except Exception:
        for grammar, s in rows:
            try:
                fill_masks([(grammar, s)], allowed)
            except Exception as e:
                req = next(i.req for i in plan.items if i.req.grammar is grammar)
                raise RowFailed(req, _grammar_field(req), e) from e
        raise


def _grammar_field(req: Req) -> str | None:
    """The sampling setting holding ``req``'s grammar."""
    return next((f for f in GRAMMARS if getattr(req.sampling, f) is not None), None)
