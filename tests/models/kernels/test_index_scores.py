"""A lightning indexer's scores over a paged key pool: the Pallas kernel (interpret mode)
against the plain-JAX reference, and the reference against a numpy loop. A ragged step:
one sequence decoding, one prefilling a chunk across query blocks, one decoding early in
its context, padding tokens; the pool's unused pages are NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.models.kernels.index_scores import kernel, reference

H, D, ROWS, NUM_PAGES, MAX_PAGES = 4, 128, 16, 24, 5
K = 12


def batch(dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = np.full((NUM_PAGES, ROWS, D), np.nan, np.float32)
    table = rng.permutation(np.arange(1, NUM_PAGES))[: 3 * MAX_PAGES].reshape(3, MAX_PAGES)
    # Sequence 0 decodes at row 70, 1 prefills rows 20..29, 2 decodes at row 3; 3 padding tokens.
    seq = np.array([0] + [1] * 10 + [2] + [0] * 3, np.int32)
    last = np.array([70, *range(20, 30), 3, -1, -1, -1], np.int32)
    for s, reach in ((0, 70), (1, 29), (2, 3)):
        for p in range(reach // ROWS + 1):  # the pages a sequence has written; the rest NaN
            keys[table[s, p]] = rng.standard_normal((ROWS, D))
        # rows past the last one seen are stale: NaN within a written page too
        keys[table[s, reach // ROWS], reach % ROWS + 1 :] = np.nan
    q = rng.standard_normal((len(seq), H, D)) * D**-0.5
    w = rng.standard_normal((len(seq), H))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), jnp.asarray(w, jnp.float32), cast(keys), *map(jnp.asarray, (table, seq, last))


def oracle(q, w, keys, table, seq, last):
    q, keys = np.asarray(q.astype(jnp.float32), np.float64), np.asarray(keys.astype(jnp.float32), np.float64)
    out = np.full((q.shape[0], MAX_PAGES * ROWS), -np.inf)
    for t in range(q.shape[0]):
        for j in range(int(last[t]) + 1):
            k = keys[table[seq[t], j // ROWS], j % ROWS]
            out[t, j] = np.sum(np.asarray(w[t]) * np.maximum(q[t] @ k, 0.0))
    return out


def test_reference_matches_the_oracle():
    args = batch("float32")
    np.testing.assert_allclose(reference.index_scores(*args), oracle(*args), rtol=1e-4, atol=1e-4)


# Blocks of 4 tokens span sequences; 1: a block a token (decode's); None: the default (32).
CASES = [("float32", 4), ("bfloat16", 4), ("float32", 1), ("bfloat16", None)]


@pytest.mark.parametrize("dtype, block_q", CASES)
def test_kernel_matches_the_reference(dtype, block_q):
    args = batch(dtype)
    # Key blocks of 2 pages, the last one partial.
    got = kernel.index_scores(*args, block_q=block_q, block_rows=2 * ROWS, interpret=True)
    want = reference.index_scores(*args)
    assert got.shape == want.shape == (15, MAX_PAGES * ROWS)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))  # same rows seen, no NaN
    np.testing.assert_array_equal(np.isneginf(got), ~np.isfinite(want))
    seen = np.isfinite(want)
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], rtol=1e-5, atol=1e-5)
    # The top-k a caller takes: the same rows (random scores: no near ties at this size).
    (gv, gi), (wv, wi) = jax.lax.top_k(got, K), jax.lax.top_k(want, K)
    pick = lambda v, i: [set(np.asarray(i)[t][np.isfinite(np.asarray(v)[t])]) for t in range(len(i))]  # noqa: E731
    assert pick(gv, gi) == pick(wv, wi)


def test_work_items_cover_each_token_once():
    _, _, _, table, seq, last = batch("float32")
    seq, last = jnp.pad(seq, (0, 1)), jnp.pad(last, (0, 1), constant_values=-1)
    blk, iseq, nblk, item = kernel.work_items(seq, last, 3, 4, 2 * ROWS)
    live = np.asarray(last) >= 0
    # a live token's item is its own query block and sequence, and reads the rows it sees
    np.testing.assert_array_equal(np.asarray(blk)[item][live], np.arange(16)[live] // 4)
    np.testing.assert_array_equal(np.asarray(iseq)[item][live], np.asarray(seq)[live])
    assert (np.asarray(nblk)[item][live] * 2 * ROWS > np.asarray(last)[live]).all()
    assert np.asarray(nblk).sum() == 7  # 5 items (blocks 0..2 over sequences 0,1 / 1 / 1,2)


def test_mismatched_widths_are_refused():
    q, w, keys, table, seq, last = batch("float32")
    with pytest.raises(ValueError, match="wide"):
        kernel.index_scores(q[..., :64], w, keys, table, seq, last, interpret=True)
