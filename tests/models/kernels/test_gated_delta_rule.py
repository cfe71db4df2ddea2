"""Gated DeltaNet against a per-token loop in numpy and transformers' PyTorch fallbacks; the
plain-JAX chunked form (``xla``) and the Pallas kernels (interpret mode) against the
sequential recurrence, ragged and slot-indexed.

Tolerance: float32, ``1e-5`` of the output's scale (as for the SSD scans). The chunked forms
solve a unit-triangular system per chunk and build decays from running sums of g; with
unit-norm keys and beta < 1 the system is well conditioned, so their rounding is ~1e-6 of
scale, while a missing decay, a wrong mask or a lost state carry is off by O(1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import backend, sharded
from hicache_jax.models.kernels.gated_delta_rule import chunked, decode_kernel, kernel, reference
from hicache_jax.models.sharding import make_mesh

H, DK, DV = 4, 8, 16  # value heads, key and value head dims
NUM_SLOTS = 8
RTOL = 1e-5


@dataclasses.dataclass
class Case:
    q: np.ndarray  # [T, H, Dk] l2-normalised and scaled
    k: np.ndarray  # [T, H, Dk] l2-normalised
    v: np.ndarray  # [T, H, Dv]
    g: np.ndarray  # [T, H]
    beta: np.ndarray  # [T, H]
    cu: np.ndarray  # [S + 1]
    num_seqs: np.ndarray  # []
    states: np.ndarray  # [NUM_SLOTS, H, Dk, Dv]; slots nobody may read hold NaN
    slots: np.ndarray  # [S]
    has_init: np.ndarray  # [S]

    @property
    def head(self) -> tuple:  # (q, k, v, g, beta, cu_seqlens, num_seqs)
        return (self.q, self.k, self.v, self.g, self.beta, self.cu, self.num_seqs)

    @property
    def args(self) -> tuple:  # the slot-indexed signature
        return self.head + (jnp.asarray(self.states), self.slots, self.has_init)

    @property
    def live(self) -> np.ndarray:  # [S] sequences that read/write a slot
        return (np.arange(len(self.slots)) < self.num_seqs) & (self.slots >= 0)

    def init_states(self) -> np.ndarray:  # [S, H, Dk, Dv]
        use = self.live & self.has_init
        src = self.states[np.maximum(self.slots, 0)]
        return np.where(use[:, None, None, None], src, 0.0).astype(np.float32)


def qk(rng, *shape) -> tuple[np.ndarray, np.ndarray]:
    """Unit-norm keys and queries scaled by Dk ** -0.5, as the layer hands them over."""
    f = lambda: np.array(reference.l2norm(rng.standard_normal(shape).astype(np.float32)))
    return f() * np.float32(shape[-1] ** -0.5), f()


def make_case(
    seed: int,
    seqs,
    *,
    num_rows: int,
    num_padding: int = 2,
    strong: bool = False,
    alike: bool = False,
    dtype=np.float32,
) -> Case:
    """``seqs``: (length, slot, has_initial_state) per live sequence; ``num_padding`` more
    sequences past ``num_seqs``. Rows past the live ones and never-read slots are NaN.
    ``strong``: model-like decays (g ~ -2 per token, |cum| ~ 100s over a chunk); else mild
    ones (g ~ -0.05), so states carry across chunks. ``alike``: near-equal keys and beta ~ 1
    under slow decay, the chunk's triangular system at its least benign (its Neumann series
    grows to 1e9 over 64 rows). ``dtype`` of q, k and v."""
    rng = np.random.default_rng(seed)
    T = num_rows
    lens = [n for n, _, _ in seqs] + [0] * num_padding
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] <= T
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, k = qk(rng, T, H, DK)
    v = f(T, H, DV)
    g = -np.exp(f(T, H) + (0.7 if strong else -3.0))
    beta = 1 / (1 + np.exp(-f(T, H)))
    if alike:
        k = np.array(reference.l2norm(k[:1] + 0.1 * k))
        beta, g = 0.9 + 0.1 * beta, g * 0.1
    slots = np.array([s for _, s, _ in seqs] + [-1] * num_padding, np.int32)
    has_init = np.array([i for _, _, i in seqs] + [True] * num_padding)
    states = f(NUM_SLOTS, H, DK, DV)
    read = {s for _, s, i in seqs if s >= 0 and i}
    for slot in set(range(NUM_SLOTS)) - read:
        states[slot] = np.nan  # a kernel that reads a slot it should not gets NaN
    for a in (q, k, v, g, beta):
        a[cu[-1] :] = np.nan  # padding rows
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    return Case(q, k, v, g, beta, cu, np.int32(len(seqs)), states, slots, has_init)


def expected(case: Case):
    """Reference o and the state pool after the step."""
    o, finals = reference.gdn_sequential(*case.head, case.init_states())
    o, finals = np.asarray(o), np.asarray(finals)
    pool = case.states.copy()
    for s in np.flatnonzero(case.live):
        pool[case.slots[s]] = finals[s]
    return o, pool


def assert_close(got, want, what: str):
    got, want = np.asarray(got), np.asarray(want)
    assert not np.isnan(got[~np.isnan(want)]).any(), f"{what}: NaN leaked"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    scale = np.abs(np.nan_to_num(want)).max(initial=0.0)  # 0 (all empty): must be exact
    np.testing.assert_allclose(
        np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=RTOL * scale, err_msg=what
    )


# Rows of every ragged case (chunks up to 16): the live rows of ``ragged_seqs(16)`` plus 5
# padding rows, not a multiple of the chunk. One row count and sequence count keep the
# tests' compiles shared.
RAGGED_ROWS = 101


def ragged_seqs(Q: int):
    """Prefill chunks of many shapes mixed with single tokens and padding sequences
    (5 Q + 16 rows)."""
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


# ----------------------------------------------------------------- the reference itself


def numpy_loop(q, k, v, g, beta, cu, num_seqs, init):
    """The recurrence as written, in float64: sequence by sequence, token by token."""
    f64 = lambda a: np.asarray(a, np.float64)
    q, k, v, g, beta = map(f64, (q, k, v, g, beta))
    o = np.zeros(v.shape)
    finals = f64(init).copy()
    for s in range(num_seqs):
        for h in range(q.shape[1]):
            S = finals[s, h]
            for t in range(cu[s], cu[s + 1]):
                S = np.exp(g[t, h]) * S
                delta = beta[t, h] * (v[t, h] - k[t, h] @ S)
                S = S + np.outer(k[t, h], delta)
                o[t, h] = q[t, h] @ S
            finals[s, h] = S
    return o, finals


def test_sequential_matches_numpy_loop():
    case = make_case(0, ragged_seqs(4), num_rows=RAGGED_ROWS)
    init = case.init_states()
    o, finals = reference.gdn_sequential(*case.head, init)
    o_want, finals_want = numpy_loop(*case.head, init)
    live = case.cu[case.num_seqs]
    assert_close(np.asarray(o)[:live], o_want[:live], "o")
    assert (np.asarray(o)[live:] == 0).all(), "padding rows of o must be 0"
    assert_close(finals, finals_want, "final states")
    assert_close(finals[-2:], init[-2:], "padding sequences keep their initial state")
    # One token per sequence: the decode step is the same recurrence.
    rows = case.cu[:4]
    o_step, new = reference.gdn_decode_step(init[:4], *(a[rows] for a in case.head[:5]))
    want_o, want_new = numpy_loop(*(a[rows] for a in case.head[:5]), np.arange(5), 4, init[:4])
    assert_close(o_step, want_o, "decode step o")
    assert_close(new, want_new, "decode step state")


def test_l2norm_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    x = np.random.default_rng(1).standard_normal((5, 3, 16)).astype(np.float32)
    x[0, 0] = 0.0  # eps keeps a zero vector zero
    want = l2norm(torch.from_numpy(x), dim=-1, eps=1e-6).numpy()
    np.testing.assert_allclose(reference.l2norm(x), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fn", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
def test_matches_transformers(fn):
    """Two sequences of 37 tokens from initial states, 2 key heads serving 4 value heads.
    transformers scales q by Dk ** -0.5 itself and repeats q, k to the value heads
    (``repeat_interleave``): it gets unit-norm q and the key heads, we get the scaled q
    repeated the same way."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    rng = np.random.default_rng(2)
    B, L, HK = 2, 37, 2
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    unit = lambda a: np.array(reference.l2norm(a))
    q, k, v = unit(f(B, L, HK, DK)), unit(f(B, L, HK, DK)), f(B, L, H, DV)
    g, beta = -np.exp(f(B, L, H) - 2.0), 1 / (1 + np.exp(-f(B, L, H)))
    init = f(B, H, DK, DV)
    t = torch.from_numpy
    kw = dict(initial_state=t(init), output_final_state=True, use_qk_l2norm_in_kernel=False)
    if fn == "torch_chunk_gated_delta_rule":
        kw["chunk_size"] = 16
    o_hf, final_hf = getattr(hf, fn)(t(q), t(k), t(v), t(g), t(beta), **kw)

    rep = lambda a: np.repeat(a, H // HK, axis=2).reshape(B * L, H, DK)
    flat = lambda a: a.reshape((B * L,) + a.shape[2:])
    cu = np.array([0, L, 2 * L], np.int32)
    args = (rep(q) * np.float32(DK**-0.5), rep(k), flat(v), flat(g), flat(beta), cu, np.int32(B), init)
    o, finals = reference.gdn_sequential(*args)
    assert_close(np.asarray(o).reshape(B, L, H, DV), o_hf.numpy(), "o vs transformers")
    assert_close(finals, final_hf.numpy(), "final states vs transformers")
    o_c, finals_c = chunked.gdn_chunked(*args, chunk=16)
    assert_close(np.asarray(o_c).reshape(B, L, H, DV), o_hf.numpy(), "chunked o vs transformers")
    assert_close(finals_c, final_hf.numpy(), "chunked final states vs transformers")


# ------------------------------------------------------------- the chunked form (xla)


@pytest.mark.parametrize("chunk,strong", [(12, False), (16, True)])
def test_chunked_matches_sequential(chunk, strong):
    case = make_case(chunk, ragged_seqs(chunk), num_rows=RAGGED_ROWS, strong=strong)
    init = case.init_states()
    o, finals = chunked.gdn_chunked(*case.head, init, chunk=chunk)
    o_want, finals_want = reference.gdn_sequential(*case.head, init)
    assert_close(o, o_want, "o")
    assert_close(finals, finals_want, "final states")
    o_slots, pool = chunked.gdn_slots(*case.args)
    o_want, pool_want = expected(case)
    assert_close(o_slots, o_want, "o (slots)")
    assert (np.asarray(o_slots)[case.cu[-1] :] == 0).all(), "padding rows of o must be 0"
    assert_close(pool, pool_want, "state pool")  # also: untouched slots keep NaN / values


# Fixed shapes (one compile); hypothesis varies lengths, slots, initial states and values.
PROP_ROWS, PROP_SEQS = 40, 5


@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.integers(0, 14), min_size=1, max_size=PROP_SEQS),
    init=st.lists(st.booleans(), min_size=PROP_SEQS, max_size=PROP_SEQS),
    no_slot=st.integers(-1, PROP_SEQS - 1),
    seed=st.integers(0, 2**16),
    strong=st.booleans(),
)
def test_slots_property(lens, init, no_slot, seed, strong):
    """Ragged batches (empty sequences included) from carried-in or fresh states: the
    chunked form equals the sequential recurrence, NaN in unused slots and padding rows
    stays out, and slots nobody owns are untouched."""
    room = PROP_ROWS
    for i, n in enumerate(lens):  # fit the rows
        lens[i] = min(n, room)
        room -= lens[i]
    slot_ids = np.random.default_rng(seed).permutation(NUM_SLOTS)[: len(lens)]
    seqs = [(n, -1 if i == no_slot else int(slot_ids[i]), init[i]) for i, n in enumerate(lens)]
    case = make_case(seed, seqs, num_rows=PROP_ROWS, num_padding=PROP_SEQS - len(lens), strong=strong)
    o, pool = chunked.gdn_slots(*case.args)  # chunk 64: one chunk per sequence
    o_want, pool_want = expected(case)
    assert_close(o, o_want, "o")
    assert_close(pool, pool_want, "state pool")
    init = case.init_states()  # and across chunks: the state carried from chunk to chunk
    o, finals = chunked.gdn_chunked(*case.head, init, chunk=4)
    assert_close(o, o_want, "o (chunk 4)")
    assert_close(finals, reference.gdn_sequential(*case.head, init)[1], "final states (chunk 4)")


def test_continuation_equals_one_pass():
    """A prefill split in two steps (the first writes the slot, the second reads it) gives the
    same o and state as one pass; so does finishing with decode steps."""
    n1, n2, slot = 70, 61, 4  # gdn_slots' chunk is 64: both parts cross a chunk boundary
    full = make_case(11, [(n1 + n2 + 2, slot, False)], num_rows=136)
    o_one, pool_one = chunked.gdn_slots(*full.args)

    def step(rows: slice, has_init: bool, states, decode=False):
        """The sequence's rows ``rows`` as one step, over the same 136 rows (NaN past them)."""
        n = rows.stop - rows.start
        take = lambda a: np.concatenate([a[rows], np.full((136 - n,) + a.shape[1:], np.nan, a.dtype)])
        c = dataclasses.replace(
            full,
            **{name: take(getattr(full, name)) for name in ("q", "k", "v", "g", "beta")},
            cu=np.array([0, n, n, n], np.int32),
            states=states,
            has_init=np.array([has_init, True, True]),
        )
        fn = chunked.gdn_decode_slots if decode else chunked.gdn_slots
        return fn(*c.args)

    o1, pool = step(slice(0, n1), False, full.states)
    o2, pool = step(slice(n1, n1 + n2), True, np.asarray(pool))
    o3, pool = step(slice(n1 + n2, n1 + n2 + 1), True, np.asarray(pool), decode=True)
    o4, pool = step(slice(n1 + n2 + 1, n1 + n2 + 2), True, np.asarray(pool), decode=True)
    o_parts = np.concatenate([np.asarray(o)[:n] for o, n in ((o1, n1), (o2, n2), (o3, 1), (o4, 1))])
    assert_close(o_parts, np.asarray(o_one)[: n1 + n2 + 2], "o over the parts")
    assert_close(pool, pool_one, "state pool after the parts")


# ------------------------------------------------------- the Pallas kernels (interpret)


# (chunk, head_block): one block of all heads (two blocks of two heads: the race test).
@pytest.mark.parametrize("chunk,head_block", [(8, None)])
def test_ragged_matches_sequential(chunk, head_block):
    case = make_case(chunk + 1, ragged_seqs(chunk), num_rows=RAGGED_ROWS)
    o_want, pool_want = expected(case)
    o, pool = kernel.gdn_ragged(*case.args, chunk=chunk, head_block=head_block, interpret=True)
    assert_close(o, o_want, "o")
    assert (np.asarray(o)[case.cu[-1] :] == 0).all(), "padding rows of o must be 0"
    assert_close(pool, pool_want, "state pool")  # also: untouched slots keep NaN / values


@pytest.mark.parametrize("kind", ["strong", "alike"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_hard_chunks(impl, kind):
    """64-row chunks, as served. ``strong``: |cum| ~ 100s over a chunk, so exp(cum_i - cum_i)
    must be exactly 1 on the diagonal. ``alike``: near-equal keys, the UT system at its
    least benign."""
    Q = 64  # over the ragged cases' rows and sequence count: shared compiles
    seqs = [(Q + 9, 0, True), (1, 5, False), (19, 2, False)]
    alike = kind == "alike"
    case = make_case(5, seqs, num_rows=RAGGED_ROWS, num_padding=7, strong=not alike, alike=alike)
    o_want, pool_want = expected(case)
    if impl == "xla":
        o, pool = chunked.gdn_slots(*case.args)
    else:
        o, pool = kernel.gdn_ragged(*case.args, chunk=Q, interpret=True)
    assert_close(o, o_want, "o")
    assert_close(pool, pool_want, "state pool")


@pytest.mark.parametrize("which", ["ragged", "decode"])
def test_tpu_interpreter_no_races(which):
    """The TPU-semantics interpreter: uninitialized VMEM is NaN and DMA races are reported."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    if which == "ragged":
        case = make_case(7, ragged_seqs(8)[:5], num_rows=48)
        o, pool = kernel.gdn_ragged(*case.args, chunk=8, head_block=2, interpret=params)
    else:
        seqs = [(1, 3, True), (1, 5, False), (1, -1, True), (1, 0, True)]
        case = make_case(8, seqs, num_rows=6)
        o, pool = decode_kernel.gdn_decode(*case.args, head_block=2, interpret=params)
    assert not interpret_pallas_call.races.races_found
    o_want, pool_want = expected(case)
    assert_close(o, o_want, "o")
    assert_close(pool, pool_want, "state pool")


def test_kernel_prefill_in_two_parts_equals_one_pass():
    """Prefill part 1 writes the slot, part 2 reads it (a continued chunk, has_initial_state):
    same o and state as one pass; then a decode step continues from the slot. (The ragged
    cases' row and sequence counts, so the compiles are shared.)"""
    Q, T, n1, n2, slot = 8, RAGGED_ROWS, 19, 14, 4
    pad = len(ragged_seqs(Q))  # padding sequences: the ragged cases' count (8 + 2)
    full = make_case(11, [(n1 + n2, slot, False), (5, 1, False)], num_rows=T, num_padding=pad)
    o_one, pool_one = kernel.gdn_ragged(*full.args, chunk=Q, interpret=True)

    def part(rows: slice, has_init: bool, states, fn):
        """The long sequence's rows ``rows`` (plus the same short neighbour) as one step."""
        n = rows.stop - rows.start

        def take(a):
            live = np.concatenate([a[rows], a[n1 + n2 : n1 + n2 + 5]])
            return np.concatenate([live, np.full((T - n - 5,) + a.shape[1:], np.nan, a.dtype)])

        c = dataclasses.replace(
            full,
            **{name: take(getattr(full, name)) for name in ("q", "k", "v", "g", "beta")},
            cu=np.array([0, n] + [n + 5] * (pad + 1), np.int32),
            states=states,
            slots=np.array([slot, 7] + [-1] * pad, np.int32),
            has_init=np.array([has_init, False] + [True] * pad),
        )
        return fn(*c.args)

    ragged = functools.partial(kernel.gdn_ragged, chunk=Q, interpret=True)
    o1, pool1 = part(slice(0, n1), False, full.states, ragged)
    o2, pool2 = part(slice(n1, n1 + n2 - 1), True, np.asarray(pool1), ragged)
    o3, pool3 = part(slice(n1 + n2 - 1, n1 + n2), True, np.asarray(pool2), chunked.gdn_slots)
    o_two = np.concatenate([np.asarray(o1)[:n1], np.asarray(o2)[: n2 - 1], np.asarray(o3)[:1]])
    assert_close(o_two, np.asarray(o_one)[: n1 + n2], "o over the parts")
    assert_close(np.asarray(pool3)[slot], np.asarray(pool_one)[slot], "state after the parts")


# (head_block, q/k/v dtype, rows): T > S (padding rows after the live ones) and T < S
# (padding sequences' rows clip onto the last live row; their o must not land there).
DECODE_CASES = [(None, np.float32, 8), (2, jnp.bfloat16, 5)]


@pytest.mark.parametrize("head_block,dtype,num_rows", DECODE_CASES)
def test_decode_matches_sequential(head_block, dtype, num_rows):
    seqs = [(1, 3, True), (1, 5, False), (1, -1, True), (1, 0, True), (1, 2, True)]
    case = make_case(3, seqs, num_rows=num_rows, dtype=dtype)
    o, pool = decode_kernel.gdn_decode(*case.args, head_block=head_block, interpret=True)
    o_want, pool_want = expected(case)  # sequential over one-token sequences
    assert_close(o, o_want, "o vs sequential")
    assert_close(pool, pool_want, "state pool")
    o_xla, pool_xla = chunked.gdn_decode_slots(*case.args)  # the xla backend's decode
    assert_close(o_xla, o_want, "gdn_decode_slots o vs sequential")
    assert_close(pool_xla, pool_want, "gdn_decode_slots state pool")


@pytest.mark.parametrize("decode", [False, True])
def test_backend_and_sharded(decode):
    """``backend.gdn_fn("pallas")`` under ``sharded.gdn`` on a 2-way mesh (2 heads per shard)
    equals the reference; ``gdn_fn("xla")`` is the chunked form's slot wrapper."""
    xla = chunked.gdn_decode_slots if decode else chunked.gdn_slots
    assert backend.gdn_fn("xla", decode=decode) is xla
    seqs = [(1, 3, True), (1, 5, False), (1, 0, True)] if decode else ragged_seqs(8)[:5]
    case = make_case(9, seqs, num_rows=8 if decode else 48)
    o_want, pool_want = expected(case)
    fn = sharded.gdn(backend.gdn_fn("pallas", interpret=True, decode=decode), make_mesh(2))
    o, pool = fn(*case.args)
    assert_close(o, o_want, "o")
    assert_close(pool, pool_want, "state pool")


def test_head_block_rule():
    """Off TPU the tile budget is v5p's (12 MiB): the largest valid block that fits, at most
    2 heads for prefill and 8 for decode; all heads when no smaller block spans whole tiles."""
    assert kernel.head_blocks(4, 8, 16) == [4]  # 2 heads are 16 / 32 lanes: not whole tiles
    assert kernel.head_blocks(6, 64, 128) == [6, 2]
    assert kernel.check_shapes(8, 128, 128, jnp.bfloat16) == (2, 8)  # Qwen3-Next at tp 4
    assert kernel.check_shapes(32, 128, 128, jnp.float32) == (2, 8)
    assert kernel.check_shapes(4, 8, 16, jnp.float32) == (4, 4)


@pytest.mark.parametrize(
    "shape,chunk,names",
    [
        ((8, 128, 128), 100, "chunk=100"),
        ((8, 100, 128), 64, "head_k_dim=100"),
        ((1, 4096, 512), 64, "head_k_dim=4096"),  # one head's state exceeds VMEM
    ],
)
def test_check_shapes_refuses_naming_the_value(shape, chunk, names):
    with pytest.raises(ValueError, match=names):
        kernel.check_shapes(*shape, jnp.bfloat16, chunk)


def test_check_model_refuses_gdn_shapes_naming_the_flag():
    """``KernelConfig.check_model`` checks a model's GDN layers (``cfg.gdn``, ``cfg.gdn_layers``)
    with ``check_shapes`` when the recurrent kernels are Pallas."""
    from types import SimpleNamespace

    gdn = SimpleNamespace(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4)
    cfg = SimpleNamespace(
        architecture="Qwen3NextForCausalLM",
        attention_layers=(),
        mamba=None,
        mamba_layers=(),
        gdn=gdn,
        gdn_layers=(0, 1, 2),
    )
    backend.KernelConfig(attention="xla", ssd="pallas").check_model(cfg, jnp.bfloat16)
    huge = SimpleNamespace(**{**vars(gdn), "head_k_dim": 4096, "head_v_dim": 512})
    with pytest.raises(
        ValueError, match="--ssd_backend=pallas cannot run Qwen3NextForCausalLM.*head_k_dim=4096"
    ):
        backend.KernelConfig(attention="xla", ssd="pallas").check_model(
            SimpleNamespace(**{**vars(cfg), "gdn": huge}), jnp.bfloat16
        )
    backend.KernelConfig(ssd="xla").check_model(SimpleNamespace(**{**vars(cfg), "gdn": huge}), jnp.bfloat16)
