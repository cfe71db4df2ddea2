"""A verify step's state trail (``ForwardBatch.state_trail``) against a recompute: after a
prompt chunk, three sequences feed 4, 2 and 1 tokens (a fourth is padding) in one step that
writes each recurrent layer's state after every token to a trail slot. For each j the trail
slot holds (conv and SSM, every recurrent layer) the state the ordinary path reaches after
feeding exactly the first j + 1 of those tokens from the same state; the step's logits and
working slots are the ordinary step's; slots the step does not name stay as they were
(NaN). For a Mamba2 hybrid and a Gated DeltaNet one, on both kernel backends (Pallas in
interpret mode) and split over 2 devices."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from hicache_jax.kinds import RECURRENT
from hicache_jax.models import CausalLM, KernelConfig
from hicache_jax.models.batch import ForwardBatch, check_state_trail, page_groups
from hicache_jax.models.presets import preset_config
from hicache_jax.models.sharding import make_mesh, shard_model
from tests.models.steps import jit_forward

PAGE = 16
PROMPTS = (3, 4, 1)  # tokens each sequence has before the verify step
Q_LENS = (4, 2, 1, 0)  # the verify step's tokens; the last sequence is padding
Q = 4
T = 8  # every step's token rows (the prompt step's 8 and the verify step's 7 padded)
WORKING = (0, 1, 2, -1)
TRAIL = np.array(
    [
        [3, 4, 5, 6],
        [7, -1, 10, 10],  # the last token's state written nowhere (the working slot has it)
        [8, 11, 11, 11],  # past q_len: ignored
        [10, 11, 10, 11],  # padding: ignored
    ],
    np.int32,
)
NUM_SLOTS = 12
UNNAMED = [9, 10, 11]
# The trail runs token by token (the decode recurrence), the ordinary path the chunked scan:
# their float32 rounding differs, and later layers see earlier layers' difference.
TOL = 1e-4  # of the largest value compared


def step_batch(groups, starts, q_lens, ids) -> ForwardBatch:
    """Sequence s (its page s + 1, its working slot ``WORKING[s]``) feeds ``ids[s]``'s
    tokens ``starts[s] : starts[s] + q_lens[s]``; every row's logits."""
    S = len(q_lens)
    tok, pos, slot_map, cu = np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, -1, np.int32), [0]
    for s, (start, n) in enumerate(zip(starts, q_lens)):
        t = cu[-1]
        p = np.arange(start, start + n)
        tok[t : t + n], pos[t : t + n], slot_map[t : t + n] = ids[s][p], p, (s + 1) * PAGE + p
        cu.append(t + n)
    live = np.array([n > 0 for n in q_lens])
    return ForwardBatch(
        input_ids=tok,
        positions=pos,
        cu_q_lens=np.array(cu, np.int32),
        kv_lens=np.where(live, np.add(starts, q_lens), 0).astype(np.int32),
        num_seqs=np.int32(int(live.sum())),
        page_tables={g: np.arange(1, S + 1, dtype=np.int32)[:, None] for g in groups},
        slot_mappings={g: slot_map for g in groups},
        state_slots=np.array(WORKING, np.int32),
        has_initial_state=np.array([st > 0 for st in starts]),
        logits_indices=np.arange(T, dtype=np.int32),
    )


def recurrent_states(model, cache) -> list[tuple[str, np.ndarray]]:
    """(name, [num_slots, ...] array) of every recurrent layer's conv and SSM state."""
    out = []
    for i, kind in enumerate(model.cfg.layer_kinds):
        if kind in RECURRENT:
            out += [(f"layer {i} {f}", np.asarray(getattr(cache[i], f))) for f in ("conv", "ssm")]
    return out


def build(preset, layers, backend, tp):
    kernels = KernelConfig(
        attention=backend, ssd=backend, interpret=True, mesh=make_mesh(tp) if tp > 1 else None
    )
    cfg = dataclasses.replace(preset_config(preset), layer_kinds=layers)
    model = CausalLM(cfg, rngs=nnx.Rngs(0), kernels=kernels)
    if tp > 1:
        shard_model(model)
    return model


MAMBA = ("tiny-mamba", ("attention", "mamba"))  # the recurrent layer reads the chunk's attention
GDN = ("tiny-qwen3.5", ("gdn", "attention"))
CASES = [
    (*MAMBA, "xla", 1),
    (*MAMBA, "pallas", 1),
    (*GDN, "xla", 1),
    (*GDN, "pallas", 1),
    (*MAMBA, "xla", 2),  # one B/C group: repeated to one per device
    (*GDN, "pallas", 2),  # a key-head group per device
]


@pytest.mark.parametrize("preset,layers,backend,tp", CASES, ids=[f"{c[0]}-{c[2]}-tp{c[3]}" for c in CASES])
def test_trail_matches_recompute(preset, layers, backend, tp):
    model = build(preset, layers, backend, tp)
    groups = page_groups(model.cfg.layer_kinds)
    params, step = jit_forward(model)
    rng = np.random.RandomState(0)
    ids = [rng.randint(0, model.cfg.vocab_size, PAGE) for _ in Q_LENS]
    cache = model.allocate_cache(
        num_pages=len(Q_LENS) + 1, page_size=PAGE, num_state_slots=NUM_SLOTS, fill=np.nan
    )
    prompt = step_batch(groups, [0] * 4, PROMPTS + (0,), ids)
    cache, _ = step(params, cache, prompt)
    before = recurrent_states(model, cache)

    def ordinary(q_lens):  # from the prompt's state, without the trail
        copy = jax.tree.map(lambda a: a.copy(), cache)
        return step(params, copy, step_batch(groups, PROMPTS + (0,), q_lens, ids))

    verify = dataclasses.replace(step_batch(groups, PROMPTS + (0,), Q_LENS, ids), state_trail=TRAIL)
    check_state_trail(verify.state_trail, verify.state_slots, verify.cu_q_lens, verify.num_seqs, NUM_SLOTS)
    want_cache, want_logits = ordinary(Q_LENS)
    got_cache, got_logits = step(params, jax.tree.map(lambda a: a.copy(), cache), verify)
    got_logits, want_logits = np.asarray(got_logits), np.asarray(want_logits)
    rows = sum(Q_LENS)
    assert not np.isnan(got_logits[:rows]).any()
    np.testing.assert_allclose(
        got_logits[:rows], want_logits[:rows], rtol=0, atol=TOL * np.abs(want_logits).max()
    )

    got = recurrent_states(model, got_cache)
    for (name, g), (_, w), (_, b) in zip(got, recurrent_states(model, want_cache), before):
        tol = TOL * np.abs(w[:3]).max()
        np.testing.assert_allclose(g[:3], w[:3], rtol=0, atol=tol, err_msg=f"{name}: working slots")
        np.testing.assert_array_equal(g[UNNAMED], b[UNNAMED], err_msg=f"{name}: a slot not named")
    for j in range(Q):
        want_j = recurrent_states(model, ordinary([min(j + 1, n) for n in Q_LENS])[0])
        for (name, g), (_, w) in zip(got, want_j):
            for s, n in enumerate(Q_LENS):
                if j < n and TRAIL[s, j] >= 0:
                    np.testing.assert_allclose(
                        g[TRAIL[s, j]],
                        w[WORKING[s]],
                        rtol=0,
                        atol=TOL * np.abs(w[WORKING[s]]).max(),
                        err_msg=f"{name}: sequence {s}, state after token {j}",
                    )


@pytest.mark.parametrize(
    "trail,slots,cu,n,match",
    [
        ([[3, 4]], [0], [0, 3], 1, "sequence 0 feeds 3 tokens, more than Q=2"),
        ([[3, 3]], [0], [0, 2], 1, "names slot 3 more than once"),
        ([[3, 1], [5, -1]], [0, 1], [0, 2, 3], 2, "names working slot 1"),
        ([[3, 9]], [0], [0, 2], 1, "names slot 9, past the pool's 8 slots"),
        ([3, 4], [0], [0, 2], 1, r"state_trail has shape \(2,\); want \[S=1, Q\]"),
    ],
)
def test_bad_trails_are_refused(trail, slots, cu, n, match):
    with pytest.raises(ValueError, match=match):
        check_state_trail(np.array(trail), np.array(slots), np.array(cu), n, num_slots=8)
    # The same trail where it is fine: past q_len and on padding sequences nothing is checked.
    check_state_trail(np.full((len(slots), 2), -1), np.array(slots) % 8, np.zeros(len(slots) + 1), n, 8)
