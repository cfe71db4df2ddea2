"""Sampling: filters give the distribution they promise; seeds make draws repeatable."""

import jax
import numpy as np
import pytest

from hicache_jax.runtime.sampler import SamplingInputs, sample
from hicache_jax.sampling_params import InvalidRequest, SamplingParams

PROBS = np.array([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
N = 4000


def draw(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0):
    logits = np.log(np.maximum(PROBS, 1e-30)).astype(np.float32)
    rows = np.tile(logits, (N, 1))
    s = SamplingInputs(
        last_rows=np.arange(N, dtype=np.int32),
        temperature=np.full(N, temperature, np.float32),
        top_p=np.full(N, top_p, np.float32),
        top_k=np.full(N, top_k, np.int32),
        min_p=np.full(N, min_p, np.float32),
        seeds=np.full(N, seed, np.uint32),
        counters=np.arange(N, dtype=np.int32),
        targets=np.zeros(N, np.int32),
    )
    out = jax.jit(sample, static_argnums=2)(rows, s, 3)
    return out


def freq(ids):
    return np.bincount(np.asarray(ids), minlength=len(PROBS)) / N


@pytest.mark.parametrize(
    "kw, keep",
    [
        ({}, [0, 1, 2, 3]),
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.5}, [0, 1]),  # 0.4 < 0.5, then 0.7 >= 0.5: tokens 0 and 1
        ({"top_p": 0.75}, [0, 1, 2]),
        ({"min_p": 0.5}, [0, 1, 2]),  # p >= 0.5 * 0.4
        ({"top_k": 3, "top_p": 0.5}, [0, 1]),
    ],
)
def test_filters_give_the_renormalised_distribution(kw, keep):
    got = freq(draw(**kw).next_ids)
    want = np.zeros_like(PROBS)
    want[keep] = PROBS[keep] / PROBS[keep].sum()
    assert set(np.nonzero(got)[0]) <= set(keep)
    assert np.abs(got - want).sum() / 2 < 0.04  # total variation; ~0.01 expected at N=4000


def test_temperature_sharpens_and_zero_is_greedy():
    hot, cold = freq(draw(temperature=2.0).next_ids), freq(draw(temperature=0.5).next_ids)
    assert cold[0] > PROBS[0] + 0.1 > hot[0] + 0.1
    assert (np.asarray(draw(temperature=0.0).next_ids) == 0).all()


def test_seed_and_counter_fix_the_draw_and_logprobs_are_raw():
    a, b, c = draw(seed=1), draw(seed=1), draw(seed=2)
    np.testing.assert_array_equal(a.next_ids, b.next_ids)
    assert (np.asarray(a.next_ids) != np.asarray(c.next_ids)).any()
    logp = np.log(PROBS[np.asarray(a.next_ids)])
    np.testing.assert_allclose(a.next_logprobs, logp, atol=1e-5)
    np.testing.assert_allclose(draw(temperature=0.3).next_logprobs[:1], [np.log(0.4)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.next_top_ids)[0], [0, 1, 2])


@pytest.mark.parametrize("rows", [5, 64, 150])  # under, at and over ROW_BLOCK (a remainder)
def test_row_logprobs_in_blocks_equal_the_whole_log_softmax(rows):
    rng = np.random.default_rng(rows)
    logits = rng.normal(0, 4, (rows, 3000)).astype(np.float32)
    targets = rng.integers(-1, 3000, rows).astype(np.int32)
    s = SamplingInputs(
        last_rows=np.array([0, rows - 1], np.int32),
        temperature=np.zeros(2, np.float32),
        top_p=np.ones(2, np.float32),
        top_k=np.full(2, -1, np.int32),
        min_p=np.zeros(2, np.float32),
        seeds=np.zeros(2, np.uint32),
        counters=np.zeros(2, np.int32),
        targets=targets,
    )
    out = jax.jit(sample, static_argnums=2)(logits, s, 4)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    want = np.take_along_axis(lp, np.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(out.target_logprobs, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(out.row_top_ids, np.argsort(-lp, axis=-1, kind="stable")[:, :4])
    np.testing.assert_allclose(out.row_top_logprobs, -np.sort(-lp, axis=-1)[:, :4], atol=1e-5)
    np.testing.assert_array_equal(out.next_ids, lp[[0, rows - 1]].argmax(-1))
    np.testing.assert_array_equal(out.next_top_ids, np.asarray(out.row_top_ids)[[0, rows - 1]])


@pytest.mark.parametrize(
    "d, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"max_new_tokens": "12"}, "max_new_tokens"),
        ({"temprature": 0.5}, "temprature"),
        ({"n": 2}, "n"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_field(d, field):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams.from_dict(d)


def test_sglang_names_accepted():
    sp = SamplingParams.from_dict({"sampling_seed": 3, "stop": "END", "stop_token_ids": [5]})
    assert sp.seed == 3 and sp.stop == ("END",) and sp.stop_token_ids == (5,)
