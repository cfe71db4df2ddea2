"""The batch builder's verify steps (speculative decoding: decodes feeding their last token
and a draft) against a plain recomputation from the requests: rows, positions, sequence
bounds, slot mappings, every token row a logits row that samples with its request's settings
and the key of the output position it predicts, the recurrent state trail, penalty rows
(a drafted row counting the draft tokens before it, its token left out of the slot's
counts), grammar masks (a regex's row j: the tokens allowed after the draft's first j, the
matcher rolled back after), and a shape warm-up compiles."""

from __future__ import annotations

import functools
import os

import llguidance.numpy
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache_jax
from hicache_jax.grammar.compiler import GrammarCompiler
from hicache_jax.grammar.constraint import Constraint
from hicache_jax.grammar.spec import GrammarKind, GrammarSpec
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.request import Req
from hicache_jax.runtime.batch_builder import BatchBuilder
from hicache_jax.runtime.penalties import STOP_ID_SLOTS
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler.plan import StepPlan, WorkItem

P = 4
MAX_RUNNING = 8  # verify buckets 16 and 32 (WIDTH * MAX_RUNNING)
WIDTH = 4  # tokens a request feeds per verify step: its last one and up to WIDTH - 1 drafted
MAX_PAGES = 12
EOS = (2,)
VOCAB = 512
REGEX = GrammarSpec(GrammarKind.REGEX, "[a-c]{2,6}")
LETTERS = (67, 68, 69, 399)  # "a", "b", "c", "ab" in the tiny tokenizer


@functools.cache
def grammars() -> GrammarCompiler:
    path = os.path.join(os.path.dirname(hicache_jax.__file__), "assets", "tiny_tokenizer.json")
    return GrammarCompiler(Tokenizer(path), VOCAB, EOS)


def builder() -> BatchBuilder:
    return BatchBuilder(
        page_size=P,
        groups=("full", "swa"),
        max_running=MAX_RUNNING,
        max_prefill=16,
        max_pages=MAX_PAGES,
        vocab_size=VOCAB,
        spec_width=WIDTH,
        eos_token_ids=EOS,
    )


@st.composite
def verify_plans(draw):
    """Up to MAX_RUNNING decodes: the first with a draft, the others with a draft of 0 to
    WIDTH - 1 tokens (now and then all of them WIDTH - 1; none for a request with a token
    still on the device, as ``scheduler/drafts.py`` decides), some with trail
    slots; now and then a one-token chunk that does not end its sequence (it samples
    nothing); distinct random pages and slots."""
    n = draw(st.sampled_from(range(1, MAX_RUNNING + 1)))  # uniform: the larger bucket too
    longest = draw(st.booleans())  # every draft as long as it can be
    pages = iter(draw(st.permutations(range(300))))
    slots = iter(draw(st.permutations(range(50))))
    items, feed_from = [], {}
    for s in range(n):
        prompt = draw(st.integers(1, 20))
        outputs = draw(st.integers(0, 10))
        penalty = s > 0 and draw(st.booleans())
        pending = draw(st.integers(0, 1)) if outputs and s > 0 else 0
        req = Req(
            rid=f"r{s}",
            input_ids=draw(st.lists(st.integers(3, 999), min_size=prompt, max_size=prompt)),
            sampling=SamplingParams(
                temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
                top_p=draw(st.sampled_from([1.0, 0.9])),
                top_k=draw(st.sampled_from([-1, 5])),
                min_p=draw(st.sampled_from([0.0, 0.1])),
                repetition_penalty=1.3 if penalty else 1.0,
                presence_penalty=draw(st.sampled_from([0.0, 0.5])) if penalty else 0.0,
                min_new_tokens=draw(st.integers(0, 3)),
                stop_token_ids=tuple(draw(st.lists(st.integers(3, 999), max_size=3))),
                ignore_eos=draw(st.booleans()),
            ),
            seed=draw(st.integers(0, 2**31 - 1)),
        )
        req.output_ids = draw(st.lists(st.integers(3, 999), min_size=outputs, max_size=outputs))
        req.pending = pending
        if penalty or draw(st.booleans()):
            req.penalty_slot = draw(st.integers(0, 7))
        if draw(st.booleans()):
            req.cache.state_slot = next(slots)
        total = req.seq_len
        samples = s == 0 or total == 1 or draw(st.integers(0, 4)) > 0
        start = total - 1 if samples else draw(st.integers(0, total - 2))
        item = WorkItem(req, start, start + 1, has_initial_state=start > 0)
        k = 0
        if samples and not pending:
            k = WIDTH - 1 if longest else draw(st.integers(1 if s == 0 else 0, WIDTH - 1))
        draft = draw(st.lists(st.integers(3, 999), min_size=k, max_size=k))
        if s > 0 and samples and not pending and draw(st.integers(0, 3)) == 0:  # a regex
            req.grammar = Constraint(grammars().matcher(REGEX))
            draft = req.grammar.valid_draft(draw(st.lists(st.sampled_from(LETTERS), min_size=k, max_size=k)))
            k = len(draft)
        if k:  # as ``add_drafts`` extends an item
            item.draft = tuple(draft)
            item.end += k
            if draw(st.booleans()):
                item.trail = tuple(next(slots) for _ in range(k))
        last = -(-item.end // P)
        req.cache.pages["full"] = [next(pages) for _ in range(last)]
        first = draw(st.integers(0, start // P))  # sliding pages before this are gone
        req.cache.pages["swa"] = [None] * first + [next(pages) for _ in range(last - first)]
        if pending:
            feed_from[req] = draw(st.integers(0, 7))
        items.append(item)
    return StepPlan(items), feed_from


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=verify_plans())
def test_verify_build_matches_a_recomputation(case):
    plan, feed_from = case
    b = builder()
    inputs = b.build(plan, feed_from=feed_from)
    batch, sampling, penalty = inputs.batch, inputs.sampling, inputs.penalty
    items = plan.items
    n = len(items)
    total = sum(i.end - i.start for i in items)
    S = 1 << (n - 1).bit_length()  # as a decode-only step's
    T = S * WIDTH  # room for every request's whole draft
    assert inputs.shape == (T, S, T, False, T) and inputs.shape.verify  # rows of several tokens
    assert inputs.shape in b.warmup_shapes(), "a shape warm-up does not compile"
    assert batch.input_ids.shape == (T,) and batch.cu_q_lens.shape == (S + 1,)
    assert int(batch.num_seqs) == n and not bool(batch.decode_only)

    ids, pos, cu, kv, feed = [], [], [0], [], [-1] * T
    slots = {"full": [], "swa": []}
    trail = np.full((S, WIDTH), -1)
    rows = []  # per token row: its sampling inputs
    pen = []  # per token row: its penalty inputs
    allowed = np.full((T, -(-VOCAB // 32)), -1, np.int32)  # grammar bitmasks (all ones: any token)
    constrained = np.zeros(T, bool)
    for s, i in enumerate(items):
        r, sp = i.req, i.req.sampling
        fill = r.input_ids + r.output_ids + [0] * r.pending
        fed = [fill[i.start]] + list(i.draft)  # the token the request ends with, then its draft
        ids += fed
        pos += list(range(i.start, i.start + len(fed)))
        for g, pages in r.cache.pages.items():
            slots[g] += [pages[p // P] * P + p % P for p in range(i.start, i.end)]
        if r.pending:
            feed[cu[-1]] = feed_from[r]
        trail[s, : len(i.trail)] = i.trail
        for j in range(len(fed) if r.grammar is not None else 0):  # the regex after draft[:j]
            matcher = grammars().matcher(REGEX)
            for tok in i.draft[:j]:
                matcher.consume_token(tok)
            llguidance.numpy.fill_next_token_bitmask(matcher, allowed, cu[-1] + j)
            constrained[cu[-1] + j] = True
        stop = list(dict.fromkeys(sp.stop_token_ids + (() if sp.ignore_eos else EOS)))
        stop = stop if sp.min_new_tokens else []
        for j in range(len(fed)):  # row j predicts output position len(output_ids) + pending + j
            rows.append(
                dict(
                    temperature=sp.temperature,
                    top_p=sp.top_p,
                    top_k=sp.top_k,
                    min_p=sp.min_p,
                    seeds=r.seed,
                    counters=len(r.output_ids) + r.pending + j,
                )
            )
            pen.append(
                dict(
                    slots=r.penalty_slot if i.samples and r.penalty_slot is not None else -1,
                    repetition=sp.repetition_penalty,
                    frequency=sp.frequency_penalty,
                    presence=sp.presence_penalty,
                    min_new_tokens=sp.min_new_tokens,
                    stop_ids=stop + [-1] * (STOP_ID_SLOTS - len(stop)),
                    # the draft tokens before row j count on top of the slot's counts, and
                    # a drafted row's token is not added to them (the engine writes them)
                    draft_ids=list(i.draft[:j]) + [-1] * (WIDTH - 1 - j),
                    counts_sample=not i.draft,
                )
            )
        cu.append(cu[-1] + len(fed))
        kv.append(i.start + len(fed))
    pad_t, pad_s = T - total, S - n
    np.testing.assert_array_equal(batch.input_ids, ids + [0] * pad_t)
    np.testing.assert_array_equal(batch.positions, pos + [0] * pad_t)
    np.testing.assert_array_equal(batch.cu_q_lens, cu + [total] * pad_s)
    np.testing.assert_array_equal(batch.kv_lens, kv + [0] * pad_s)
    for g in ("full", "swa"):
        np.testing.assert_array_equal(batch.slot_mappings[g], slots[g] + [-1] * pad_t)
    np.testing.assert_array_equal(batch.feed_rows, feed)
    np.testing.assert_array_equal(batch.state_trail, trail)
    want_state = [-1 if i.req.cache.state_slot is None else i.req.cache.state_slot for i in items]
    np.testing.assert_array_equal(batch.state_slots, want_state + [-1] * pad_s)
    np.testing.assert_array_equal(batch.has_initial_state, [i.start > 0 for i in items] + [False] * pad_s)
    assert list(inputs.first_rows) == cu[:n]
    assert inputs.sample_rows == tuple(cu[s] if i.samples else -1 for s, i in enumerate(items))

    # Every token row is a logits row and samples.
    np.testing.assert_array_equal(batch.logits_indices, np.arange(T))
    np.testing.assert_array_equal(sampling.last_rows, np.arange(T))
    # Prompt logprobs only for a one-token chunk that does not end its prompt: its row
    # scores the prompt's next token.
    targets = np.full(T, -1)
    for s, i in enumerate(items):
        if not i.samples:
            targets[cu[s]] = i.req.fill_ids[i.end]
    np.testing.assert_array_equal(sampling.targets, targets)
    neutral = dict(temperature=0, top_p=1, top_k=-1, min_p=0, seeds=0, counters=0)
    for field in neutral:
        want = [row[field] for row in rows] + [neutral[field]] * pad_t
        np.testing.assert_allclose(getattr(sampling, field), want, rtol=0, atol=1e-6, err_msg=field)
    np.testing.assert_array_equal(sampling.constrained, constrained)
    np.testing.assert_array_equal(sampling.allowed, allowed)
    for i in items:  # a drafted matcher is rolled back: it allows what a fresh one does
        if i.req.grammar is not None:
            masks = np.zeros((2, allowed.shape[1]), np.int32)
            llguidance.numpy.fill_next_token_bitmask(i.req.grammar.matcher, masks, 0)
            llguidance.numpy.fill_next_token_bitmask(grammars().matcher(REGEX), masks, 1)
            np.testing.assert_array_equal(masks[0], masks[1])

    neutral = dict(
        slots=-1,
        repetition=1,
        frequency=0,
        presence=0,
        min_new_tokens=0,
        stop_ids=[-1] * STOP_ID_SLOTS,
        draft_ids=[-1] * (WIDTH - 1),
        counts_sample=True,
    )
    for field in neutral:
        want = np.array([p[field] for p in pen] + [neutral[field]] * pad_t, np.float64)
        np.testing.assert_allclose(getattr(penalty, field), want, rtol=0, atol=1e-6, err_msg=field)
