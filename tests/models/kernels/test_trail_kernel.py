"""The verify-chunk kernels (``trail_kernel.ssd_trail``, ``gdn_trail``, interpret mode)
against their plain-JAX reference (``state_trail.trail_reference``), and the reference
against the one-token step applied token by token in a Python loop: outputs of every live
token, and the whole state pool (working slots, trail slots, the zeroed slot of a fresh
sequence without tokens; every other slot NaN, untouched). Sequences: 4, 0 (fresh, a slot),
2 (fresh), 1, 3 tokens, a padding one; some trail entries -1, the last token's included.

Tolerance: float32, ``1e-5`` of each array's scale (the kernel and the reference run the
same step; their matmuls round differently)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.models.kernels import state_trail, trail_kernel

Q, NUM_SLOTS = 4, 24
Q_LENS = [4, 0, 2, 1, 3, 0]  # the last: padding
NUM_SEQS = 5
HAS_INIT = [True, False, False, True, True, False]
WORKING = [0, 1, 2, 3, 4, -1]
TRAIL = [[5, 6, 7, -1], [8, 9, 10, 11], [12, 13, -1, -1], [14, 22, 22, 22], [15, -1, 16, 22], [22] * 4]
RTOL = 1e-5


def layout(seed: int):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
    T = int(cu[-1]) + 2  # two padding rows
    slots_trail = np.concatenate([np.array(WORKING)[:, None], np.array(TRAIL)], axis=1).astype(np.int32)
    return rng, cu, T, slots_trail


def ssd_case(dtype, seed=0):
    rng, cu, T, slots_trail = layout(seed)
    H, P, G, N = 4, 8, 2, 16
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    ops = (
        jnp.asarray(f(T, H, P), dtype),
        jnp.asarray(np.log1p(np.exp(f(T, H))) * 0.5),  # dt > 0
        -jnp.asarray(np.arange(1, H + 1, dtype=np.float32)),  # A
        jnp.asarray(f(T, G, N), dtype),
        jnp.asarray(f(T, G, N), dtype),
        jnp.ones((H,), jnp.float32),
    )
    states = np.full((NUM_SLOTS, H, P, N), np.nan, np.float32)
    return ops, cu, slots_trail, states, "ssd", trail_kernel.ssd_trail


def gdn_case(dtype, seed=0):
    rng, cu, T, slots_trail = layout(seed)
    H, Dk, Dv = 4, 8, 16
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    ops = (
        jnp.asarray(unit(f(T, H, Dk)) * Dk**-0.5, dtype),
        jnp.asarray(unit(f(T, H, Dk)), dtype),
        jnp.asarray(f(T, H, Dv), dtype),
        jnp.asarray(-np.abs(f(T, H))),  # log-decay <= 0
        jnp.asarray(1 / (1 + np.exp(-f(T, H)))),  # beta in (0, 1)
    )
    states = np.full((NUM_SLOTS, H, Dk, Dv), np.nan, np.float32)
    return ops, cu, slots_trail, states, "gdn", trail_kernel.gdn_trail


def with_initial_states(states, seed=1):
    """The slots of sequences that read one hold a state; every other slot stays NaN."""
    rng = np.random.default_rng(seed)
    states = states.copy()
    for s, (slot, init) in enumerate(zip(WORKING, HAS_INIT)):
        if s < NUM_SEQS and init:
            states[slot] = rng.standard_normal(states.shape[1:]) * 0.5
    return states


def loop(kind, ops, cu, slots_trail, states):
    """Each live sequence's tokens one at a time through the kind's one-token step."""
    r = state_trail.KINDS[kind]
    states = states.copy()
    out = {}  # row -> its output
    for s in range(NUM_SEQS):
        slot = WORKING[s]
        h = states[slot][None] if HAS_INIT[s] else np.zeros((1,) + states.shape[1:], np.float32)
        for j in range(Q_LENS[s]):
            row = cu[s] + j
            o, h = r.step(jnp.asarray(h), *(a[row : row + 1] if t else a for a, t in zip(ops, r.per_token)))
            h, out[row] = np.asarray(h), np.asarray(o[0])
            if slots_trail[s, 1 + j] >= 0:
                states[slots_trail[s, 1 + j]] = h[0]
        states[slot] = h[0]  # zeros for the fresh sequence without tokens
    return out, states


def assert_close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    scale = np.nanmax(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * scale, err_msg=what)  # NaN where NaN


@pytest.mark.parametrize("make", [ssd_case, gdn_case], ids=["ssd", "gdn"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_reference_matches_loop(make, dtype):
    ops, cu, slots_trail, states, kind, kernel = make(dtype)
    states = with_initial_states(states)
    args = (cu, np.int32(NUM_SEQS), jnp.asarray(states), slots_trail, np.array(HAS_INIT))
    r = state_trail.KINDS[kind]
    want_out, want_states = state_trail.trail_reference(r.step, r.per_token, *ops, *args)
    loop_out, loop_states = loop(kind, ops, cu, slots_trail, states)
    live_rows = np.arange(ops[0].shape[0]) < cu[NUM_SEQS]
    assert sorted(loop_out) == list(np.flatnonzero(live_rows))
    loop_rows = np.stack([loop_out[t] for t in sorted(loop_out)])
    assert_close(np.asarray(want_out)[live_rows], loop_rows, "reference out vs loop")
    assert_close(want_states, loop_states, "reference states vs loop")
    args = (cu, np.int32(NUM_SEQS), jnp.asarray(states), slots_trail, np.array(HAS_INIT))  # fresh pool
    got_out, got_states = functools.partial(kernel, interpret=True)(*ops, *args)
    assert not np.isnan(np.asarray(got_out)[live_rows]).any()
    assert_close(np.asarray(got_out)[live_rows], np.asarray(want_out)[live_rows], "kernel out")
    assert_close(got_states, want_states, "kernel states")
