"""Mamba2 SSD scans against the sequential recurrence: the plain-JAX chunked scan (``xla``)
and the Pallas kernels (interpret mode), ragged and slot-indexed.

Tolerance: float32, ``1e-5`` of the output's scale. The chunked forms add the same terms in
another order and build decays as ``exp(cum_i - cum_j)`` from running sums instead of a
product of per-step factors; rounding of a sum of up to ``chunk`` log-decays (|cum| ~ 10 here)
gives ~``eps * |cum|`` ~ 1e-6 relative error, so 1e-5 leaves headroom while a wrong mask,
a missing state carry or a misplaced row is off by O(1).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels.mamba2_ssd import chunked, decode_kernel, kernel, reference

H, P, N = 4, 8, 16  # heads, head dim, state size
NUM_SLOTS = 8
RTOL = 1e-5


@dataclasses.dataclass
class Case:
    x: np.ndarray  # [T, H, P]
    dt: np.ndarray  # [T, H]
    A: np.ndarray  # [H]
    B: np.ndarray  # [T, G, N]
    C: np.ndarray  # [T, G, N]
    D: np.ndarray  # [H]
    cu: np.ndarray  # [S + 1]
    num_seqs: np.ndarray  # []
    states: np.ndarray  # [NUM_SLOTS, H, P, N]; slots nobody may read hold NaN
    slots: np.ndarray  # [S]
    has_init: np.ndarray  # [S]

    @property
    def args(self):
        return (
            self.x,
            self.dt,
            self.A,
            self.B,
            self.C,
            self.D,
            self.cu,
            self.num_seqs,
            jnp.asarray(self.states),
            self.slots,
            self.has_init,
        )

    @property
    def live(self) -> np.ndarray:  # [S] sequences that read/write a slot
        return (np.arange(len(self.slots)) < self.num_seqs) & (self.slots >= 0)

    def init_states(self) -> np.ndarray:  # [S, H, P, N]
        use = self.live & self.has_init
        src = self.states[np.maximum(self.slots, 0)]
        return np.where(use[:, None, None, None], src, 0.0).astype(np.float32)


def make_case(
    seed: int,
    seqs,
    *,
    groups: int,
    num_rows: int,
    num_padding: int = 2,
    strong: bool = False,
    dtype=np.float32,
) -> Case:
    """``seqs``: (length, slot, has_initial_state) per live sequence; ``num_padding`` more
    sequences past ``num_seqs``. Rows past the live ones and never-read slots are NaN.
    ``strong``: model-like decays (A_h = -2h, dt ~ 1.3), so |cumsum| over a chunk is ~100s.
    ``dtype`` of x, B and C (the references read the same rounded values)."""
    rng = np.random.default_rng(seed)
    T, G = num_rows, groups
    lens = [n for n, _, _ in seqs] + [0] * num_padding
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] <= T
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    x, B, C = f(T, H, P), f(T, G, N), f(T, G, N)
    dt = np.log1p(np.exp(f(T, H) + (1.0 if strong else -1.0)))  # softplus: ~1.3 or ~0.3
    A = -np.exp(rng.uniform(np.log(0.05), 0.0, H)).astype(np.float32)  # mild: states matter
    if strong:
        A = -2.0 * np.arange(1, H + 1, dtype=np.float32)
    slots = np.array([s for _, s, _ in seqs] + [-1] * num_padding, np.int32)
    has_init = np.array([i for _, _, i in seqs] + [True] * num_padding)
    states = f(NUM_SLOTS, H, P, N)
    read = {s for _, s, i in seqs if s >= 0 and i}
    for slot in set(range(NUM_SLOTS)) - read:
        states[slot] = np.nan  # a kernel that reads a slot it should not gets NaN
    for a in (x, dt, B, C):
        a[cu[-1] :] = np.nan  # padding rows
    x, B, C = (a.astype(dtype) for a in (x, B, C))
    return Case(x, dt, A, B, C, f(H), cu, np.int32(len(seqs)), states, slots, has_init)


def expected(case: Case):
    """Reference y and the state pool after the step."""
    y, finals = reference.ssd_sequential(*case.args[:8], case.init_states())
    y, finals = np.asarray(y), np.asarray(finals)
    pool = case.states.copy()
    for s in np.flatnonzero(case.live):
        pool[case.slots[s]] = finals[s]
    return y, pool


def assert_close(got, want, what: str):
    got, want = np.asarray(got), np.asarray(want)
    assert not np.isnan(got[~np.isnan(want)]).any(), f"{what}: NaN leaked"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    scale = np.nanmax(np.abs(want))
    np.testing.assert_allclose(
        np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=RTOL * scale, err_msg=what
    )


def ragged_seqs(Q: int):
    """Prefill chunks of many shapes mixed with single tokens and padding sequences."""
    return [
        (1, 3, True),  # a decode token
        (0, -1, False),  # zero-length padding sequence (no slot)
        (Q + 3, 0, True),  # not a multiple of the chunk, carried-in state
        (1, 5, False),  # fresh single token
        (3 * Q + 5, 2, True),  # several chunks
        (0, 6, False),  # empty fresh sequence: its slot becomes zeros
        (7, -1, True),  # computed, but no slot to read or write
        (Q - 1, 1, False),  # fresh prefill, ends one short of a chunk
    ]


# (chunk, groups, head_block): G=1, one group per head block, head blocks of two groups.
CONFIGS = [(8, 1, None), (16, 2, 2), (64, 4, 2)]


@pytest.mark.parametrize("chunk,groups,head_block", CONFIGS)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_ragged_matches_sequential(impl, chunk, groups, head_block):
    seqs = ragged_seqs(chunk)
    rows = sum(n for n, _, _ in seqs) + 5  # padding rows, and T not a multiple of the chunk
    case = make_case(chunk + groups, seqs, groups=groups, num_rows=rows)
    y_want, pool_want = expected(case)
    if impl == "xla":  # the chunked scan itself, on gathered initial states
        y, finals = chunked.ssd_chunked(*case.args[:8], case.init_states(), chunk=chunk)
        y_ref, finals_ref = reference.ssd_sequential(*case.args[:8], case.init_states())
        assert_close(finals, finals_ref, "final states")
        pool = chunked.ssd_slots(*case.args)[1]
    else:
        y, pool = kernel.ssd_ragged(*case.args, chunk=chunk, head_block=head_block, interpret=True)
    assert_close(y, y_want, "y")
    assert (np.asarray(y)[case.cu[-1] :] == 0).all(), "padding rows of y must be 0"
    assert_close(pool, pool_want, "state pool")  # also: untouched slots keep NaN / values


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_strong_decay_long_chunk(impl):
    """|cum| ~ 600 over a chunk: exp(cum_i - cum_j) must be exactly 1 on the diagonal (the
    kernel's two orientations of the cumsum must be the same numbers), else eps * |cum| lands
    on the dominant term of y."""
    Q, seqs = 64, ragged_seqs(64)
    rows = sum(n for n, _, _ in seqs) + 5
    case = make_case(5, seqs, groups=2, num_rows=rows, strong=True)
    y_want, pool_want = expected(case)
    if impl == "xla":
        y = chunked.ssd_chunked(*case.args[:8], case.init_states(), chunk=Q)[0]
        pool = chunked.ssd_slots(*case.args)[1]
    else:
        y, pool = kernel.ssd_ragged(*case.args, chunk=Q, interpret=True)
    assert_close(y, y_want, "y")
    assert_close(pool, pool_want, "state pool")


@pytest.mark.parametrize("which", ["ragged", "decode"])
def test_tpu_interpreter_no_races(which):
    """The TPU-semantics interpreter: uninitialized VMEM is NaN and DMA races are reported."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    if which == "ragged":
        case = make_case(7, ragged_seqs(8)[:5], groups=2, num_rows=48)
        y, pool = kernel.ssd_ragged(*case.args, chunk=8, head_block=2, interpret=params)
    else:
        seqs = [(1, 3, True), (1, 5, False), (1, -1, True), (1, 0, True)]
        case = make_case(8, seqs, groups=2, num_rows=6)
        y, pool = decode_kernel.ssd_decode(*case.args, head_block=2, interpret=params)
    assert not interpret_pallas_call.races.races_found
    y_want, pool_want = expected(case)
    assert_close(y, y_want, "y")
    assert_close(pool, pool_want, "state pool")


def test_prefill_in_two_parts_equals_one_pass():
    """Prefill part 1 writes the slot, part 2 reads it: same y and state as one pass."""
    Q, T, n1, n2, slot = 16, 56, 23, 27, 4
    full = make_case(11, [(n1 + n2, slot, False), (5, 1, False)], groups=2, num_rows=T)
    y_one, pool_one = kernel.ssd_ragged(*full.args, chunk=Q, interpret=True)

    def part(rows: slice, has_init: bool, states):
        """The long sequence's rows ``rows`` (plus the same short neighbour) as one step."""
        n = rows.stop - rows.start
        take = lambda a: np.concatenate([a[rows], a[n1 + n2 : n1 + n2 + 5], a[n + 5 :]])[:T]
        c = dataclasses.replace(
            full,
            x=take(full.x),
            dt=take(full.dt),
            B=take(full.B),
            C=take(full.C),
            cu=np.array([0, n, n + 5, n + 5], np.int32),
            states=states,
            slots=np.array([slot, 7, -1], np.int32),
            has_init=np.array([has_init, False, True]),
        )
        return kernel.ssd_ragged(*c.args, chunk=Q, interpret=True)

    y1, pool1 = part(slice(0, n1), False, full.states)
    y2, pool2 = part(slice(n1, n1 + n2), True, np.asarray(pool1))
    y_two = np.concatenate([np.asarray(y1)[:n1], np.asarray(y2)[:n2]])
    assert_close(y_two, np.asarray(y_one)[: n1 + n2], "y over both parts")
    assert_close(np.asarray(pool2)[slot], np.asarray(pool_one)[slot], "state after both parts")


# (groups, head_block, x/B/C dtype, rows): T > S (padding rows after the live ones, and a
# bucket of rows well past the sequences) and T < S (padding sequences' rows clip onto the
# last live row; their y must not land there).
DECODE_CASES = [
    (1, None, np.float32, 8),
    (2, 2, jnp.bfloat16, 20),
    (1, None, jnp.bfloat16, 5),
]


@pytest.mark.parametrize("groups,head_block,dtype,num_rows", DECODE_CASES)
def test_decode_matches_step_and_sequential(groups, head_block, dtype, num_rows):
    seqs = [(1, 3, True), (1, 5, False), (1, -1, True), (1, 0, True), (1, 2, True)]
    case = make_case(3, seqs, groups=groups, num_rows=num_rows, dtype=dtype)
    y, pool = decode_kernel.ssd_decode(*case.args, head_block=head_block, interpret=True)
    y_want, pool_want = expected(case)  # sequential over one-token sequences
    assert_close(y, y_want, "y vs sequential")
    assert_close(pool, pool_want, "state pool")
    rows = case.cu[:-1][: len(seqs)]
    y_step, new = reference.ssd_decode_step(
        case.init_states()[: len(seqs)],
        case.x[rows],
        case.dt[rows],
        case.A,
        case.B[rows],
        case.C[rows],
        case.D,
    )
    assert_close(np.asarray(y)[rows], y_step, "y vs ssd_decode_step")
    live = np.flatnonzero(case.live)
    assert_close(np.asarray(pool)[case.slots[live]], np.asarray(new)[live], "states vs step")


def test_head_block_rule():
    """Off TPU the tile budget is v5p's (12 MiB): the largest valid block <= 8 that fits,
    else the smallest valid one that fits."""
    assert kernel.head_blocks(10, 1, 64) == [10, 2]  # 5 heads are 320 lanes: not whole tiles
    assert kernel.pick_head_block(16, 1, 64, 128, jnp.bfloat16, chunk=128) == 8
    assert kernel.pick_head_block(16, 1, 256, 128, jnp.bfloat16, chunk=256) == 2  # VMEM-bound
    assert kernel.pick_head_block(24, 8, 32, 64, jnp.float32) == 12  # 3 per group, 4 per tile
    assert kernel.check_shapes(128, 1, 64, 128, jnp.bfloat16) == (8, 8)


@pytest.mark.parametrize(
    "shape,chunk,names",
    [
        ((6, 4, 64, 128), 128, "num_heads=6 must divide by num_groups=4"),
        ((16, 1, 64, 128), 100, "chunk=100"),
        ((1, 1, 4096, 128), 128, "head_dim=4096"),  # one head's blocks exceed VMEM
    ],
)
def test_check_shapes_refuses_naming_the_value(shape, chunk, names):
    with pytest.raises(ValueError, match=names):
        kernel.check_shapes(*shape, jnp.bfloat16, chunk)
