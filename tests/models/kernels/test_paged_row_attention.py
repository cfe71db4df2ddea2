"""Attention over per-token row lists of a paged pool: the Pallas kernel (interpret mode)
against the plain-JAX reference, the reference against a numpy oracle, and ``merge``
against one softmax over every source and the sink.

Every batch is poisoned: pool pages no listed row lies in hold NaN, as do the page-table
entries no valid row reaches (ids out of range), padding tokens' queries and the rows after
each token's last valid one in its page. Tokens mix decode (a few rows) and prefill (many),
with invalid ids scattered, trailing, or all of them; any NaN in the output fails.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.models.kernels.paged_row_attention import kernel, reference

ROWS = 16  # rows per page
PAGES = 24
MAX_PAGES = 6  # per sequence: 96 rows
D, H = 128, 4
N = 200  # rows a token lists: two blocks of 128
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def batch(dtype: str, seed: int = 0):
    """Three sequences over a NaN-poisoned pool; 7 tokens with ragged, partly invalid lists."""
    rng = np.random.default_rng(seed)
    pool = np.full((PAGES, ROWS, D), np.nan, np.float32)
    table = np.full((4, MAX_PAGES), 10_000, np.int32)  # unreached entries: out of range
    lens = [96, 40, 7]  # rows each sequence holds
    free = list(rng.permutation(PAGES - 1) + 1)
    for s, n in enumerate(lens):
        for p in range(-(-n // ROWS)):
            page = free.pop()
            table[s, p] = page
            k = min(ROWS, n - p * ROWS)
            pool[page, :k] = rng.standard_normal((k, D))
    seq = np.array([0, 0, 1, 1, 2, 0, 3], np.int32)  # token 6: a padding token (seq 3: no pages)
    idx = np.full((len(seq), N), -1, np.int32)
    idx[0] = rng.integers(0, 96, N)  # prefill-like: every id valid, repeats
    idx[1, :150] = rng.integers(0, 96, 150)  # valid prefix, both blocks
    idx[2, :5] = [39, 0, 17, -1, 3]  # decode-like: a few
    idx[3] = np.where(rng.random(N) < 0.5, rng.integers(0, 40, N), -1)  # scattered
    idx[4, 130:137] = np.arange(7)  # only in the second block
    idx[5, :] = -1  # none
    q = rng.standard_normal((len(seq), H, D)).astype(np.float32)
    q[6] = np.nan
    dt = jnp.dtype(dtype)
    return tuple(jnp.asarray(x) for x in (q.astype(dt), pool.astype(dt), table, seq, idx))


def oracle(q, pool, table, seq, idx, scale):
    q, pool = np.asarray(q, np.float64), np.asarray(pool, np.float64)
    T = q.shape[0]
    o, lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for t in range(T):
        ids = [i for i in np.asarray(idx[t]) if i >= 0]
        if not ids:
            continue
        rows = np.stack([pool[table[seq[t], i // ROWS], i % ROWS] for i in ids])  # [n, D]
        s = q[t] @ rows.T * scale  # [H, n]
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        o[t] = e @ rows / e.sum(-1, keepdims=True)
        lse[t] = m[:, 0] + np.log(e.sum(-1))
    return o, lse


def check(o, lse, o_ref, lse_ref, dtype):
    live = np.asarray(lse_ref) > -np.inf
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert np.array_equal(np.asarray(lse) > -np.inf, live)
    np.testing.assert_allclose(
        np.asarray(lse)[live], np.asarray(lse_ref)[live], atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_reference_matches_the_oracle():
    args = batch("float32")
    o, lse = reference.paged_row_attention(*args, sm_scale=D**-0.5)
    want_o, want_lse = oracle(*args, D**-0.5)
    want_o[6], want_lse[6] = 0.0, -np.inf  # the padding token lists nothing
    check(o, lse, want_o, want_lse, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_matches_the_reference(dtype):
    args = batch(dtype, seed=1)
    want = reference.paged_row_attention(*args, sm_scale=D**-0.5)
    got = kernel.paged_row_attention(*args, sm_scale=D**-0.5, interpret=True)
    check(*got, *want, dtype)


def test_merge_is_one_softmax_over_every_source_and_the_sink():
    q, pool, table, seq, idx = batch("float32", seed=2)
    sinks = jnp.asarray([0.5, -1.0, 3.0, 0.0])
    split = [jnp.where(jnp.arange(N) < 100, idx, -1), jnp.where(jnp.arange(N) >= 100, idx, -1)]
    parts = [reference.paged_row_attention(q, pool, table, seq, i, sm_scale=0.1) for i in split]
    got = reference.merge(parts, sinks)
    # The sink as one more row whose score is the sink and whose value is zero.
    o, lse = reference.paged_row_attention(q, pool, table, seq, idx, sm_scale=0.1)
    m = jnp.maximum(lse, sinks[None])
    want = o * (jnp.exp(lse - m) / (jnp.exp(lse - m) + jnp.exp(sinks[None] - m)))[..., None]
    want = jnp.where(jnp.isnan(want), 0.0, want)  # the padding token: lse = -inf
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
