"""The batch builder against a plain recomputation from the requests: rows, positions,
sequence bounds, page tables, slot mappings, logits rows and sampling inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.request import Req
from hicache_jax.runtime.batch_builder import BatchBuilder, RowFailed
from hicache_jax.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from hicache_jax.scheduler.plan import StepPlan, WorkItem

P = 4
MAX_RUNNING = 4
MAX_PREFILL = 16
MAX_PAGES = 12


def builder(groups=("full", "swa")) -> BatchBuilder:
    return BatchBuilder(
        page_size=P,
        groups=groups,
        max_running=MAX_RUNNING,
        max_prefill=MAX_PREFILL,
        max_pages=MAX_PAGES,
        vocab_size=512,
    )


@st.composite
def plans(draw):
    """Up to MAX_RUNNING requests, each a prefill chunk or a decode token, with distinct
    random pages (the sliding group missing pages before the chunk)."""
    n = draw(st.integers(1, MAX_RUNNING))
    pages = iter(draw(st.permutations(range(100))))
    items, feed_from, budget = [], {}, MAX_PREFILL
    for s in range(n):
        prompt = draw(st.integers(1, 30))
        outputs = draw(st.integers(0, 12))
        pending = draw(st.integers(0, 1)) if outputs else 0
        req = Req(
            rid=f"r{s}",
            input_ids=draw(st.lists(st.integers(3, 999), min_size=prompt, max_size=prompt)),
            sampling=SamplingParams(
                temperature=draw(st.sampled_from([0.0, 0.7])), top_k=draw(st.sampled_from([-1, 5]))
            ),
            seed=draw(st.integers(0, 2**31 - 1)),
            return_logprob=draw(st.booleans()),
            logprob_start_len=draw(st.integers(-1, prompt)),
            top_logprobs_num=draw(st.integers(0, 2)),
        )
        req.output_ids = draw(st.lists(st.integers(3, 999), min_size=outputs, max_size=outputs))
        req.pending = pending
        total = req.seq_len
        if draw(st.booleans()) or budget < 1:  # decode: the last token
            start = total - 1
        else:
            start = draw(st.integers(0, total - 1))
        end = start + 1 if start == total - 1 else draw(st.integers(start + 1, min(total, start + budget)))
        if end - start > 1:
            budget -= end - start
        k = -(-end // P)
        req.cache.pages["full"] = [next(pages) for _ in range(k)]
        first = draw(st.integers(0, start // P))  # sliding pages before this are gone
        req.cache.pages["swa"] = [None] * first + [next(pages) for _ in range(k - first)]
        if pending:
            feed_from[req] = draw(st.integers(0, 7))
        items.append(WorkItem(req, start, end, has_initial_state=start > 0))
    return StepPlan(items), feed_from


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=plans())
def test_build_matches_a_recomputation(case):
    plan, feed_from = case
    b = builder()
    inputs = b.build(plan, feed_from=feed_from)
    batch, sampling, top, first_rows = inputs.batch, inputs.sampling, inputs.top_logprobs, inputs.first_rows
    items = plan.items
    n = len(items)
    total = sum(i.end - i.start for i in items)
    decode_only = all(i.end - i.start == 1 for i in items)
    if decode_only:
        S = 1
        while S < n:
            S *= 2
        T = S
    else:
        S = MAX_RUNNING
        T = min(x for x in b.buckets if x >= total)
    per_token = any(
        i.req.return_logprob and i.req.logprob_start_len >= 0 and i.start < i.req.input_len for i in items
    )
    R = T if per_token else S
    assert batch.input_ids.shape == (T,) and batch.cu_q_lens.shape == (S + 1,)
    assert batch.logits_indices.shape == (R,) and sampling.targets.shape == (R,)
    assert int(batch.num_seqs) == n and bool(batch.decode_only) == decode_only

    ids, pos, cu, kv = [], [], [0], []
    slots = {"full": [], "swa": []}
    logits, targets, last = [], [], []
    for i in items:
        r = i.req
        fill = r.input_ids + r.output_ids + [0] * r.pending
        rows = list(range(cu[-1], cu[-1] + i.end - i.start))
        ids += fill[i.start : i.end]
        pos += list(range(i.start, i.end))
        for g, pages in r.cache.pages.items():
            slots[g] += [pages[p // P] * P + p % P for p in range(i.start, i.end)]
        targets += [fill[q + 1] if q + 1 < len(fill) else -1 for q in range(i.start, i.end)]
        last.append(rows[-1])
        logits.append(rows[-1])
        cu.append(cu[-1] + len(rows))
        kv.append(i.end)
    pad_t, pad_s = T - total, S - n
    np.testing.assert_array_equal(batch.input_ids, ids + [0] * pad_t)
    np.testing.assert_array_equal(batch.positions, pos + [0] * pad_t)
    np.testing.assert_array_equal(batch.cu_q_lens, cu + [total] * pad_s)
    np.testing.assert_array_equal(batch.kv_lens, kv + [0] * pad_s)
    for g in ("full", "swa"):
        np.testing.assert_array_equal(batch.slot_mappings[g], slots[g] + [-1] * pad_t)
        want = np.zeros((S, MAX_PAGES), np.int32)
        for s, i in enumerate(items):
            pages = i.req.cache.pages[g]
            want[s, : len(pages)] = [0 if p is None else p for p in pages]
        np.testing.assert_array_equal(batch.page_tables[g], want)
    assert list(first_rows) == cu[:n]
    assert inputs.sample_rows == tuple(s if i.samples else -1 for s, i in enumerate(items))
    if R == T:  # a row per token (in a decode-only step with T = S that is also a row per sequence)
        np.testing.assert_array_equal(batch.logits_indices, np.arange(T))
        np.testing.assert_array_equal(sampling.last_rows, last + [0] * pad_s)
        np.testing.assert_array_equal(sampling.targets, targets + [-1] * pad_t)
    else:
        np.testing.assert_array_equal(batch.logits_indices, logits + [0] * pad_s)
        np.testing.assert_array_equal(sampling.last_rows, list(range(n)) + [0] * pad_s)
        assert (sampling.targets == -1).all()
    feed = [-1] * T
    for s, i in enumerate(items):
        if i.req.pending:
            feed[cu[s + 1] - 1] = feed_from[i.req]
    np.testing.assert_array_equal(batch.feed_rows, feed)
    np.testing.assert_array_equal(batch.has_initial_state, [i.start > 0 for i in items] + [False] * pad_s)
    np.testing.assert_array_equal(sampling.seeds, [i.req.seed for i in items] + [0] * pad_s)
    np.testing.assert_array_equal(
        sampling.counters, [len(i.req.output_ids) + i.req.pending for i in items] + [0] * pad_s
    )
    np.testing.assert_array_equal(sampling.top_k, [i.req.sampling.top_k for i in items] + [-1] * pad_s)
    wants_top = any(i.req.return_logprob and i.req.top_logprobs_num for i in items)
    assert top == (MAX_TOP_LOGPROBS if wants_top else 0)
    assert inputs.shape[:4] == (T, S, R, decode_only) and not inputs.shape.verify
    assert inputs.shape in b.warmup_shapes(), "a shape warm-up does not compile"


def test_a_missing_page_for_a_written_position_is_an_error():
    req = Req(rid="x", input_ids=list(range(3, 13)), sampling=SamplingParams())
    req.cache.pages["full"] = [0, 1, 2]
    req.cache.pages["swa"] = [None, 5, 6]  # page 0's sliding KV is gone, but the chunk writes it
    with pytest.raises(RowFailed, match="no swa page") as e:  # the engine fails that request alone
        builder().build(StepPlan([WorkItem(req, 2, 10)]))
    assert e.value.req is req and isinstance(e.value.cause, RuntimeError)
