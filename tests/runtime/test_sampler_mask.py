"""Grammar bitmasks in the jitted sampler: the masked logits equal llguidance's own numpy
masking (the reference), constrained rows only ever choose allowed tokens (greedy and
sampled, with top-k/top-p/min-p), unconstrained rows in the same batch are untouched, and
logprobs stay those of the raw distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import llguidance.numpy as llg_np
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.runtime.sampler import SamplingInputs, masked, sample


def _bits(allowed: np.ndarray, V: int) -> np.ndarray:
    """[S, V] bool: the tokens a [S, W] bitmask allows (bit t % 32 of word t // 32)."""
    words = allowed.view(np.uint32)
    t = np.arange(V)
    return ((words[:, t // 32] >> (t % 32).astype(np.uint32)) & 1).astype(bool)


@st.composite
def batches(draw):
    S = draw(st.integers(1, 6))
    V = draw(st.integers(2, 200))
    W = -(-V // 32)
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    density = draw(st.sampled_from([0.02, 0.3, 0.9]))
    allowed = np.packbits(rng.random((S, W * 32)) < density, axis=1, bitorder="little").view(np.int32)
    allowed = np.ascontiguousarray(allowed.reshape(S, W))
    for s in range(S):  # at least one allowed token below V per row (the engine ensures it)
        t = int(rng.integers(V))
        allowed[s, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    constrained = rng.random(S) < 0.6
    logits = rng.normal(size=(S, V)).astype(np.float32) * 3
    return logits, allowed, constrained, rng


@settings(max_examples=40, deadline=None)
@given(batches())
def test_masked_equals_llguidance_reference(batch):
    logits, allowed, constrained, _ = batch
    got = np.asarray(jax.jit(masked)(logits, allowed, constrained))
    ref = logits.copy()
    rows = np.flatnonzero(constrained)
    if len(rows):
        sub = ref[rows]
        llg_np.apply_token_bitmask_inplace(sub, allowed[rows])
        ref[rows] = sub
    np.testing.assert_array_equal(got, ref)


@settings(max_examples=25, deadline=None)
@given(batches(), st.sampled_from(["greedy", "plain", "top_k", "top_p", "min_p"]))
def test_constrained_rows_choose_allowed_tokens(batch, mode):
    logits, allowed, constrained, rng = batch
    S, V = logits.shape
    temp = {"greedy": 0.0}.get(mode, 1.0)
    s = SamplingInputs(
        last_rows=np.arange(S, dtype=np.int32),
        temperature=np.full(S, temp, np.float32),
        top_p=np.full(S, 0.8 if mode == "top_p" else 1.0, np.float32),
        top_k=np.full(S, 3 if mode == "top_k" else -1, np.int32),
        min_p=np.full(S, 0.1 if mode == "min_p" else 0.0, np.float32),
        seeds=rng.integers(0, 2**32, S, dtype=np.uint32),
        counters=np.zeros(S, np.int32),
        targets=np.zeros(S, np.int32),
        allowed=allowed,
        constrained=constrained,
    )
    out = jax.jit(sample, static_argnums=2)(logits, s, 2)
    unmasked = jax.jit(sample, static_argnums=2)(logits, s.__class__(**{**s.__dict__, "allowed": None}), 2)
    ok = _bits(allowed, V)
    ids = np.asarray(out.next_ids)
    for r in range(S):
        if constrained[r]:
            assert ok[r, ids[r]], (r, ids[r])
            if mode == "greedy":
                assert ids[r] == np.flatnonzero(ok[r])[np.argmax(logits[r, ok[r]])]
        else:  # the same token as a batch without any mask
            assert ids[r] == int(unmasked.next_ids[r])
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(np.asarray(out.next_logprobs), raw[np.arange(S), ids], rtol=1e-5, atol=1e-5)
