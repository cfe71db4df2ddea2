"""The bounded sampler draws the reference's tokens for the same keys, and takes
the reference only for rows whose filters need more than its candidates.

The reference runs one row at a time, as a batch of one: a row's token must not depend on
its batch, and the reference is batch-invariant only to float32 rounding (a [1, V] and a
[12, V] run can cut top-p one token apart when a cumulative sum is an ulp from top_p).
"""

import functools

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.runtime import sampler_reference as reference
from hicache_jax.runtime.sampler import (
    CANDIDATES,
    REFERENCE_BELOW,
    SamplingInputs,
    _threshold,
    filtered_logits,
    row_keys,
    sample,
)

S, V, R, K = 12, REFERENCE_BELOW, 14, 3  # the smallest vocabulary that takes the bounded path
C = CANDIDATES

sample_jit = jax.jit(sample, static_argnums=2)
categorical_jit = jax.jit(jax.vmap(jax.random.categorical))  # the reference's draw
filtered_jit = jax.jit(filtered_logits)
reference_filtered_jit = jax.jit(reference.filtered_logits)
threshold_jit = jax.jit(functools.partial(_threshold, c=C))

row = st.tuples(
    st.sampled_from(["greedy", "sampled", "sampled"]),
    st.sampled_from([0.3, 0.7, 1.0, 1.6]),  # temperature
    st.sampled_from([-1, -1, 1, 2, 7, 50, C, C + 1, 700, V - 1, V, V + 5]),  # top_k
    st.one_of(st.just(1.0), st.floats(0.02, 1.0)),  # top_p
    st.one_of(st.just(0.0), st.floats(0.0, 0.6)),  # min_p
    st.sampled_from([0.3, 1.5, 4.0, 8.0, 30.0]),  # logit scale: flat .. peaked
    st.booleans(),  # coarse logits: many exact ties
)


def make(rows, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((R, V)).astype(np.float32)
    last_rows = rng.permutation(R)[:S].astype(np.int32)
    for i, (*_, scale, coarse) in zip(last_rows, rows):
        logits[i] *= scale
        if coarse:
            logits[i] = np.round(logits[i] * 2) / 2
    kind, temp, top_k, top_p, min_p, *_ = zip(*rows)
    s = SamplingInputs(
        last_rows=last_rows,
        temperature=np.where(np.array(kind) == "greedy", 0.0, temp).astype(np.float32),
        top_p=np.array(top_p, np.float32),
        top_k=np.array(top_k, np.int32),
        min_p=np.array(min_p, np.float32),
        seeds=rng.integers(0, 2**32, S, dtype=np.uint32),
        counters=rng.integers(0, 1000, S).astype(np.int32),
        targets=rng.integers(-1, V, R).astype(np.int32),
    )
    return logits, s


def reference_rows(logits_s, s):
    """The reference's tokens and filtered logits, its filter run row by row."""
    one = lambda v, i: v[i : i + 1]  # noqa: E731
    settings = (s.temperature, s.top_p, s.top_k, s.min_p)
    filtered = np.concatenate(
        [reference_filtered_jit(one(logits_s, i), *(one(v, i) for v in settings)) for i in range(S)]
    )
    drawn = categorical_jit(row_keys(s), filtered)
    return np.where(s.temperature < 1e-5, np.argmax(logits_s, -1), drawn), filtered


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(row, min_size=S, max_size=S), seed=st.integers(0, 2**31))
def test_same_tokens_as_the_reference_and_raw_logprobs(rows, seed):
    logits, s = make(rows, seed)
    out = sample_jit(logits, s, K)
    logits_s = logits[s.last_rows]
    want, want_f = reference_rows(logits_s, s)
    np.testing.assert_array_equal(out.next_ids, want)
    # The filtered vectors agree too, not just the drawn token (greedy rows: unspecified).
    sampled = np.asarray(s.temperature) >= 1e-5
    np.testing.assert_array_equal(np.asarray(filtered_jit(logits_s, s))[sampled], want_f[sampled])
    # Logprobs: the raw distribution, recomputed in float64.
    lp = log_softmax64(logits)
    ids = np.asarray(out.next_ids)
    np.testing.assert_allclose(out.next_logprobs, lp[s.last_rows, ids], rtol=1e-6, atol=1e-6)
    tgt = np.maximum(s.targets, 0)
    np.testing.assert_allclose(out.target_logprobs, lp[np.arange(R), tgt], rtol=1e-6, atol=1e-6)
    top = -np.sort(-lp, axis=-1)[:, :K]
    np.testing.assert_allclose(out.row_top_logprobs, top, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        np.take_along_axis(lp, np.asarray(out.row_top_ids), -1), top, rtol=1e-6, atol=1e-6
    )
    np.testing.assert_array_equal(out.next_top_ids, np.asarray(out.row_top_ids)[s.last_rows])


def test_reference_only_for_rows_the_candidates_cannot_settle():
    """Rows (settings, logit scale, coarse) and whether they need the reference (None: ties
    decide, counted here in numpy)."""
    cases = [
        # settled by the candidates
        (("sampled", 1.0, -1, 1.0, 0.0, 1.5, False), False),  # pure temperature
        (("sampled", 1.0, -1, 1.0, 0.3, 0.3, False), False),  # min-p only, flat
        (("sampled", 1.0, 40, 1.0, 0.0, 0.3, False), False),  # top-k inside C, flat
        (("sampled", 0.7, C, 0.9, 0.0, 0.3, False), False),  # top-k = C with top-p
        (("sampled", 1.0, -1, 0.9, 0.05, 8.0, False), False),  # top-p, peaked
        (("sampled", 1.0, 5, 1.0, 0.0, 1.0, True), None),  # a small tie group at the cut
        # need the reference
        (("sampled", 1.0, C + 1, 1.0, 0.0, 1.5, False), True),  # top-k past C
        (("sampled", 1.0, -1, 0.9, 0.0, 0.3, False), True),  # top-p, flat: C holds too little
        (("sampled", 1.0, 250, 1.0, 0.0, 0.3, True), None),  # the cut's tie group passes C
        (("sampled", 1.0, 250, 0.5, 0.0, 0.3, True), None),  # same, top-p cutting above it
    ]
    rows = [r for r, _ in cases] + [cases[0][0]] * (S - len(cases))
    logits, s = make(rows, seed=7)
    logits_s = logits[s.last_rows]
    tempered = np.asarray(logits_s) / s.temperature[:, None]
    spills = {i: (tempered[i] >= np.sort(tempered[i])[::-1][s.top_k[i] - 1]).sum() > C for i in (5, 8, 9)}
    assert not spills[5] and spills[8] and spills[9]
    want = [w if w is not None else spills[i] for i, (_, w) in enumerate(cases)]
    full = np.asarray(threshold_jit(tempered, s)[1])
    assert full.tolist() == want + [False] * (S - len(cases))
    np.testing.assert_array_equal(sample_jit(logits, s, 0).next_ids, reference_rows(logits_s, s)[0])


def test_all_greedy_batch_is_the_argmax():
    rows = [("greedy", 1.0, -1, 1.0, 0.0, 0.3, False)] * S
    logits, s = make(rows, seed=3)
    np.testing.assert_array_equal(sample_jit(logits, s, 0).next_ids, logits[s.last_rows].argmax(-1))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(row, min_size=S, max_size=S), seed=st.integers(0, 2**31))
def test_rows_split_by_vocabulary_draw_the_same_tokens(rows, seed):
    """Under a mesh the sampled rows stay split by vocabulary (as the runner keeps them):
    the per-shard maxima, sums, candidates and noise give the reference's tokens."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    split, whole = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P())
    logits, s = make(rows, seed)
    run = jax.jit(sample, static_argnums=2, static_argnames=("rows_sharding", "out_sharding"))
    out = run(jax.device_put(logits, split), s, K, rows_sharding=split, out_sharding=whole)
    assert out.next_ids.sharding.is_fully_replicated
    want, _ = reference_rows(logits[s.last_rows], s)
    np.testing.assert_array_equal(out.next_ids, want)
    lp = log_softmax64(logits)
    np.testing.assert_allclose(out.next_logprobs, lp[s.last_rows, np.asarray(want)], rtol=1e-6, atol=1e-6)
