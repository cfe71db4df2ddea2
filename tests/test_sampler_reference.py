"""The reference sampler's value sort (int32 keys) orders floats as numpy does (specials,
signed zeros, denormals and ties included), and its two-level cumulative sum is a cumsum."""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hicache_jax.sampler_reference import cumulative_sum, sorted_values

sorted_jit = jax.jit(sorted_values)
SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-39, -1e-39, 3.4e38, -3.4e38, 1.0, -1.0]
floats = st.one_of(st.sampled_from(SPECIAL), st.floats(width=32, allow_nan=True, allow_infinity=True))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=2, max_side=300), elements=floats))
def test_sorted_values_are_numpys_sort(x):
    got = np.asarray(sorted_jit(x))
    want = np.sort(x, axis=-1)  # NaN last; -0.0 and 0.0 equal
    assert got.shape == want.shape
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (x[~same.all(-1)] if x.ndim > 1 else x, got[~same], want[~same])


cumulative_jit = jax.jit(cumulative_sum, static_argnums=1)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([1, 2, 127, 1023, 1024, 1025, 5000]),  # a few widths: few compiles
    st.sampled_from([1, 7, 128, 1024]),
    st.integers(0, 2**31 - 1),
)
def test_cumulative_sum_is_cumsum_to_rounding(V, block, seed):
    p = np.random.default_rng(seed).dirichlet(np.full(V, 0.3)).astype(np.float32)[None]
    got = np.asarray(cumulative_jit(p, block))
    want = np.cumsum(p.astype(np.float64), axis=-1)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
