"""The verify-chunk kernels (``trail_kernel.ssd_trail``, ``gdn_trail``, interpret mode)
against their plain-JAX reference (``state_trail.trail_reference``), and the reference
against the one-token step applied token by token in a Python loop: outputs of every live
token, and the whole state pool (working slots, trail slots, the zeroed slot of a fresh
sequence without tokens; every other slot NaN, untouched). A fixed layout (4, 0 tokens on a
fresh slot, 2 fresh, 1, 3, padding; some trail entries -1, the last token's included) in
float32 and bfloat16, and layouts hypothesis draws (a sequence without a working slot
among them).

Tolerance: float32, ``1e-5`` of each array's scale (the kernel and the reference run the
same step; their matmuls round differently)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.models.kernels import state_trail, trail_kernel

RTOL = 1e-5


@dataclasses.dataclass
class Layout:
    q_lens: list[int]  # per sequence, padding ones (past num_seqs) included
    num_seqs: int
    has_init: list[bool]
    working: list[int]  # -1: none
    trail: list[list[int]]  # [S, Q]
    num_slots: int
    pad_rows: int = 2

    @property
    def cu(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)

    @property
    def slots_trail(self) -> np.ndarray:  # [S, 1 + Q]
        return np.concatenate([np.array(self.working)[:, None], np.array(self.trail)], axis=1).astype(
            np.int32
        )


FIXED = Layout(
    q_lens=[4, 0, 2, 1, 3, 0],  # the last: padding
    num_seqs=5,
    has_init=[True, False, False, True, True, False],
    working=[0, 1, 2, 3, 4, -1],
    trail=[[5, 6, 7, -1], [8, 9, 10, 11], [12, 13, -1, -1], [14, 22, 22, 22], [15, -1, 16, 22], [22] * 4],
    num_slots=24,
)


def ssd_case(lay: Layout, dtype, rng):
    T = int(lay.cu[-1]) + lay.pad_rows
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
    return ops, (H, P, N)


def gdn_case(lay: Layout, dtype, rng):
    T = int(lay.cu[-1]) + lay.pad_rows
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
    return ops, (H, Dk, Dv)


CASES = {"ssd": (ssd_case, trail_kernel.ssd_trail), "gdn": (gdn_case, trail_kernel.gdn_trail)}


def initial_states(lay: Layout, state: tuple, rng) -> np.ndarray:
    """A NaN pool whose slots of sequences that read one hold a state."""
    states = np.full((lay.num_slots, *state), np.nan, np.float32)
    for s in range(lay.num_seqs):
        if lay.has_init[s] and lay.working[s] >= 0:
            states[lay.working[s]] = rng.standard_normal(state) * 0.5
    return states


def loop(kind: str, lay: Layout, ops, states):
    """Each live sequence's tokens one at a time through the kind's one-token step:
    ({row: output}, states)."""
    r = state_trail.KINDS[kind]
    states, out, cu = states.copy(), {}, lay.cu
    for s in range(lay.num_seqs):
        slot = lay.working[s]
        read = lay.has_init[s] and slot >= 0
        h = states[slot][None] if read else np.zeros((1,) + states.shape[1:], np.float32)
        for j in range(lay.q_lens[s]):
            row = cu[s] + j
            o, h = r.step(jnp.asarray(h), *(a[row : row + 1] if t else a for a, t in zip(ops, r.per_token)))
            h, out[row] = np.asarray(h), np.asarray(o[0])
            if lay.trail[s][j] >= 0:
                states[lay.trail[s][j]] = h[0]
        if slot >= 0:
            states[slot] = h[0]  # zeros for a fresh sequence without tokens
    return out, states


def assert_close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    finite = np.abs(want[np.isfinite(want)])
    scale = finite.max() if finite.size else 0.0
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * scale, err_msg=what)  # NaN where NaN


def check(kind: str, lay: Layout, dtype, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    make, kernel = CASES[kind]
    ops, state = make(lay, dtype, rng)
    states = initial_states(lay, state, rng)
    args = lambda: (
        lay.cu,
        np.int32(lay.num_seqs),
        jnp.asarray(states),
        lay.slots_trail,
        np.array(lay.has_init),
    )
    r = state_trail.KINDS[kind]
    reference = jax.jit(functools.partial(state_trail.trail_reference, r.step, r.per_token))
    want_out, want_states = reference(*ops, *args())
    loop_out, loop_states = loop(kind, lay, ops, states)
    live_rows = np.arange(ops[0].shape[0]) < lay.cu[lay.num_seqs]
    assert sorted(loop_out) == list(np.flatnonzero(live_rows))
    if loop_out:  # some token is live
        loop_rows = np.stack([loop_out[t] for t in sorted(loop_out)])
        assert_close(np.asarray(want_out)[live_rows], loop_rows, "reference out vs loop")
    assert_close(want_states, loop_states, "reference states vs loop")
    got_out, got_states = functools.partial(kernel, interpret=True)(*ops, *args())
    assert not np.isnan(np.asarray(got_out)[live_rows]).any()
    assert_close(np.asarray(got_out)[live_rows], np.asarray(want_out)[live_rows], "kernel out")
    assert_close(got_states, want_states, "kernel states")


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_reference_matches_loop(kind, dtype):
    check(kind, FIXED, dtype)


S, Q = 4, 3  # drawn layouts: fixed shapes (one compile per kind), 12 token rows


@st.composite
def layouts(draw) -> Layout:
    num_seqs = draw(st.integers(1, S))
    q_lens = [draw(st.integers(0, Q)) if s < num_seqs else 0 for s in range(S)]
    has_init = [draw(st.booleans()) for _ in range(S)]
    # Distinct slots: the working ones first (some -1: from zeros, no write), then the trail's.
    slots = draw(st.permutations(range(S + S * Q)))
    working = [slots[s] if draw(st.integers(0, 3)) else -1 for s in range(S)]
    trail = [[slots[S + s * Q + j] if draw(st.booleans()) else -1 for j in range(Q)] for s in range(S)]
    pad = S * Q - sum(q_lens)  # every layout has S * Q token rows
    return Layout(q_lens, num_seqs, has_init, working, trail, num_slots=S + S * Q + 1, pad_rows=pad)


@pytest.mark.parametrize("kind", list(CASES))
@settings(max_examples=8, deadline=None)
@given(lay=layouts(), seed=st.integers(0, 2**16))
def test_drawn_layouts(kind, lay, seed):
    check(kind, lay, jnp.float32, seed)
