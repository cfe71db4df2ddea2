"""The device penalties against a plain numpy statement of each definition, written from the
token lists (not from counts): repetition (CTRL / transformers), frequency and presence
(OpenAI), and ``min_new_tokens``' held-back stop tokens; and the slots' bookkeeping."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.runtime import penalties
from hicache_jax.runtime.penalties import STOP_ID_SLOTS, PenaltyInputs, Slots
from hicache_jax.runtime.sampler import SamplingInputs, sample

V, SLOTS = 48, 6


def numpy_penalised(logits, prompt, output, rep, freq, pres, min_new, stops, generated=None):
    """One row, from its definitions (``generated``: tokens generated so far, when the
    penalties do not see the output)."""
    x = np.array(logits, np.float64)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= freq * output.count(t) + pres
    if (len(output) if generated is None else generated) < min_new:
        x[list(stops)] = -np.inf
    return x


row = st.tuples(
    st.booleans(),  # has a slot
    st.lists(st.integers(0, V - 1), max_size=12),  # prompt
    st.lists(st.integers(0, V - 1), max_size=10),  # output so far
    st.sampled_from([1.0, 0.5, 1.3, 2.0]),  # repetition
    st.sampled_from([0.0, 0.4, -1.0, 2.0]),  # frequency
    st.sampled_from([0.0, 0.7, -0.5]),  # presence
    st.integers(0, 12),  # min_new_tokens
    st.lists(st.integers(0, V - 1), max_size=4, unique=True),  # stop tokens
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(row, min_size=1, max_size=SLOTS), seed=st.integers(0, 2**31))
def test_penalised_logits_follow_the_definitions(rows, seed):
    rng = np.random.default_rng(seed)
    S = len(rows)
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    p = PenaltyInputs.neutral(S)
    counts = np.zeros((SLOTS, V), np.int32)
    generated = np.zeros(S, np.int32)
    for s, (slotted, prompt, output, rep, freq, pres, min_new, stops) in enumerate(rows):
        if slotted:  # a slot holds the row's counts; without one, penalties see nothing
            p.slots[s] = s
            # the prompt and all but the last output token from the host; the last one as a
            # step adds it on the device
            counts[s] = penalties.seed_row(prompt, output[:-1], V)
        p.repetition[s], p.frequency[s], p.presence[s] = rep, freq, pres
        p.min_new_tokens[s] = min_new
        p.stop_ids[s, : len(stops)] = stops
        generated[s] = len(output)
    last = np.array([r[2][-1] if r[0] and r[2] else 0 for r in rows], np.int32)
    step_p = PenaltyInputs(**{**vars(p), "slots": np.where([r[0] and bool(r[2]) for r in rows], p.slots, -1)})
    counts = jax.jit(penalties.counted)(counts, step_p, last)
    got = np.asarray(jax.jit(penalties.penalised)(logits, p, counts, generated))
    for s, (slotted, prompt, output, rep, freq, pres, min_new, stops) in enumerate(rows):
        seen = (prompt, output) if slotted else ([], [])
        want = numpy_penalised(logits[s], *seen, rep, freq, pres, min_new, stops, generated=len(output))
        np.testing.assert_allclose(got[s], want, rtol=1e-6, atol=1e-6, err_msg=f"row {s}")


def test_a_batch_without_penalties_is_untouched():
    logits = np.random.default_rng(0).standard_normal((4, V)).astype(np.float32)
    counts = np.full((SLOTS, V), 3, np.int32)  # stale counts of former holders: unused
    out = jax.jit(penalties.penalised)(logits, PenaltyInputs.neutral(4), counts, np.zeros(4, np.int32))
    np.testing.assert_array_equal(out, logits)
    again = jax.jit(penalties.counted)(counts, PenaltyInputs.neutral(4), np.arange(4, dtype=np.int32))
    np.testing.assert_array_equal(again, counts)


def test_tokens_are_chosen_from_penalised_logits_and_logprobs_stay_raw():
    rng = np.random.default_rng(1)
    S = 3
    logits = rng.standard_normal((S, V)).astype(np.float32)
    top = logits.argmax(-1)
    s = SamplingInputs(
        last_rows=np.arange(S, dtype=np.int32),
        temperature=np.zeros(S, np.float32),  # greedy
        top_p=np.ones(S, np.float32),
        top_k=np.full(S, -1, np.int32),
        min_p=np.zeros(S, np.float32),
        seeds=np.zeros(S, np.uint32),
        counters=np.zeros(S, np.int32),
        targets=np.full(S, -1, np.int32),
    )
    p = PenaltyInputs.neutral(S)
    p.slots[0], p.presence[0] = 0, 2.0  # row 0: its argmax token already seen in the output
    counts = np.zeros((SLOTS, V), np.int32)
    counts[0, top[0]] = 1
    p.min_new_tokens[1], p.stop_ids[1, 0] = 5, top[1]  # row 1: its argmax is a held-back stop token
    out = jax.jit(sample, static_argnums=2)(logits, s, 0, penalty=(p, counts))
    want = [numpy_penalised(logits[0], [], [top[0]], 1.0, 0.0, 2.0, 0, []).argmax()]
    want += [numpy_penalised(logits[1], [], [], 1.0, 0.0, 0.0, 5, [top[1]]).argmax(), top[2]]
    np.testing.assert_array_equal(out.next_ids, want)
    assert out.next_ids[0] != top[0] and out.next_ids[1] != top[1]
    raw = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(out.next_logprobs, np.asarray(raw)[np.arange(S), want], rtol=1e-6)


class R:  # a request as the slots see it
    penalty_slot = None


def test_slots_are_held_until_released_and_taken_from_requests_not_stepping():
    slots = Slots(2)
    a, b, c = R(), R(), R()
    assert slots.assign(a, {a}) == 0 and slots.assign(b, {a, b}) == 1
    with pytest.raises(RuntimeError, match="penalty slots"):
        slots.assign(c, {a, b, c})  # both holders are in the step
    assert slots.assign(c, {a, c}) == 1  # b is not (retracted): it gives its slot up
    assert b.penalty_slot is None and c.penalty_slot == 1
    slots.release(a)
    assert a.penalty_slot is None and slots.assign(b, {b}) == 0
    slots.reset()
    assert b.penalty_slot is None and c.penalty_slot is None and not slots.holders


def test_min_new_tokens_with_too_many_stop_tokens_is_refused():
    from hicache_jax.sampling_params import InvalidRequest, SamplingParams

    sp = SamplingParams(min_new_tokens=2, stop_token_ids=tuple(range(STOP_ID_SLOTS)))
    with pytest.raises(InvalidRequest, match="min_new_tokens .* not supported"):
        penalties.held_back(sp, eos_token_ids=(STOP_ID_SLOTS,))
    assert penalties.held_back(sp, eos_token_ids=(0,)) == list(range(STOP_ID_SLOTS))


def test_repetition_and_min_new_tokens_are_transformers_definitions():
    """The numpy statement above is transformers' own ``RepetitionPenaltyLogitsProcessor``
    (over prompt and output) and ``MinNewTokensLengthLogitsProcessor``."""
    import torch
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    rng = np.random.default_rng(2)
    prompt, output = rng.integers(0, V, 9).tolist(), rng.integers(0, V, 5).tolist()
    logits = rng.standard_normal(V).astype(np.float32) * 3
    ids = torch.tensor([prompt + output])
    for rep in (0.7, 1.5):
        hf = RepetitionPenaltyLogitsProcessor(rep)(ids, torch.tensor(logits[None]))[0].numpy()
        np.testing.assert_allclose(numpy_penalised(logits, prompt, output, rep, 0, 0, 0, []), hf, rtol=1e-6)
    stops = [3, 17]
    for min_new in (5, 6):
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), min_new, stops)(ids, torch.tensor(logits[None]))
        ours = numpy_penalised(logits, [], output, 1.0, 0, 0, min_new, stops)
        np.testing.assert_array_equal(ours, hf[0].numpy().astype(np.float64))
