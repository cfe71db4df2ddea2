"""The reference sampler's search-based cuts are the sorted-vocabulary definition: top-k
keeps the values at or above the k-th largest, top-p the smallest sorted prefix reaching
top_p (ties together), checked against numpy's sort in float64 on generated rows, ties and
every top-k included (rows within float32 rounding of a top-p boundary are left out)."""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.runtime.sampler_reference import filtered_logits

V = 300
filtered_jit = jax.jit(filtered_logits)


def sorted_definition(x: np.ndarray, top_p: float, top_k: int) -> tuple[np.ndarray, float]:
    """-> (kept [V] bools, distance of the nearest cumulative sum to top_p)."""
    order = np.sort(x)[::-1]
    k = min(top_k, V) if top_k > 0 else V
    kept = x >= order[k - 1]
    p = np.where(kept, np.exp(x.astype(np.float64) - x.max()), 0.0)
    p /= p.sum()
    ps = np.sort(p)[::-1]
    before = np.cumsum(ps) - ps
    if top_p < 1:
        cutoff = ps[before < top_p].min()
        kept &= p >= cutoff
    return kept, float(np.abs(before - top_p).min())


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(["normal", "ties", "peaked"]),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.one_of(st.just(1.0), st.floats(0.01, 0.999)),
    st.sampled_from([-1, 1, 2, 5, 40, V - 1, V, V + 3]),
)
def test_cuts_are_the_sorted_definition(seed, kind, temperature, top_p, top_k):
    rng = np.random.default_rng(seed)
    logits = {
        "normal": rng.standard_normal(V),
        "ties": rng.integers(-4, 4, V) / 2,  # few distinct values
        "peaked": rng.standard_normal(V) * 8,
    }[kind].astype(np.float32)
    x = logits / np.float32(max(temperature, 1e-5))
    kept, margin = sorted_definition(x, top_p, top_k)
    if top_p < 1 and margin < 1e-5:
        return  # a cumulative sum at top_p to float32 rounding: either cut is the definition
    f32 = lambda v: np.asarray([v], np.float32)
    got = np.asarray(
        filtered_jit(logits[None], f32(temperature), f32(top_p), np.asarray([top_k], np.int32), f32(0))
    )
    np.testing.assert_array_equal(np.isfinite(got[0]), kept)
