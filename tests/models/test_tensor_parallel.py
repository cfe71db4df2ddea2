"""Tensor parallelism on the 8 emulated CPU devices: every family gives the logits (within
1e-4, float32) and greedy tokens of ``tp_size=1`` at each size its heads divide, over
chunked prefill, a mixed step and decode steps; the xla backend at every size, the Pallas
kernels (interpret mode) at one. The HF families have 4 query heads, so ``tp_size=8`` runs
on a hybrid built here with 8 (and KV heads replicated 4 times).

Costs are compiles (two programs per model and size), so each family runs the sizes in a
row and the tp=1 reference once."""

import numpy as np
import pytest
from flax import nnx

from hicache_jax.models import (
    CausalLM,
    KernelConfig,
    MambaConfig,
    ModelConfig,
    build_batch,
    load_hf,
    make_step,
)
from hicache_jax.models.batch import page_group
from hicache_jax.models.presets import preset_config
from hicache_jax.models.sharding import check_tp, make_mesh, shard_model

P = 16
ATOL = 1e-4

HYBRID8 = ModelConfig(
    architecture="test:hybrid8",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    layer_kinds=("mamba", "sliding", "attention"),
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    sliding_window=20,
    mamba=MambaConfig(num_heads=8, head_dim=8, state_size=8, num_groups=2, conv_kernel=4, chunk_size=16),
)


def steps(model):
    """Seq A prefills 20 tokens in two chunks beside B's 9; then A's last 12 beside B's
    decode (mixed); then two decode-only steps. Returns each step's logits."""
    params, step = make_step(model)
    groups = tuple(sorted({page_group(k) for k in model.cfg.layer_kinds if k != "mamba"}))
    cache = model.allocate_cache(num_pages=8, page_size=P, num_state_slots=2)
    rng = np.random.RandomState(0)
    a, b = rng.randint(0, 512, 35).tolist(), rng.randint(0, 512, 12).tolist()
    out = []
    plan = (((10, 0), (9, 0)), ((10, 10), (0, 9)), ((12, 20), (1, 9)), ((1, 32), (1, 10)), ((1, 33), (1, 11)))
    for (na, ca), (nb, cb) in plan:
        seqs = [(a[ca : ca + na], ca, [1, 2, 3]), (b[cb : cb + nb], cb, [5])]
        seqs = [s for s in seqs if s[0]]
        decode = all(len(s[0]) == 1 for s in seqs)
        batch = build_batch(
            seqs,
            groups=groups,
            page_size=P,
            num_tokens=None if decode else 24,
            num_seqs=2,
            max_pages=3,
            logits="last",
            num_logits=2,
            state_slots=[0, 1][: len(seqs)],
            has_initial_state=[s[1] > 0 for s in seqs],
        )
        cache, logits = step(params, cache, batch)
        out.append(np.asarray(logits)[: len(seqs)])
    return out


def assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=ATOL, err_msg=f"{what}, step {i}")
        # Greedy: the same token, unless the reference's top two are a near-tie.
        top2 = np.sort(w, axis=-1)[:, -2:]
        differ = g.argmax(-1) != w.argmax(-1)
        assert not (differ & (top2[:, 1] - top2[:, 0] > ATOL)).any(), f"{what}, step {i}: greedy differs"


def kernels(backend, tp):
    return KernelConfig(
        attention=backend, ssd=backend, interpret=True, mesh=make_mesh(tp) if tp > 1 else None
    )


@pytest.mark.parametrize("family", ["mistral", "gemma3", "bamba", "llama"])
def test_families_match_tp1(checkpoint_dir, family):
    path = checkpoint_dir(family)
    want = steps(load_hf(path, kernels=kernels("xla", 1)))
    heads = load_hf(path).cfg.num_heads
    sizes = [tp for tp in (2, 4, 8) if heads % tp == 0]
    for tp in sizes:
        assert_same(steps(load_hf(path, kernels=kernels("xla", tp))), want, f"{family} xla tp={tp}")
    assert_same(steps(load_hf(path, kernels=kernels("pallas", 2))), want, f"{family} pallas tp=2")


def test_tp8_hybrid_with_replicated_kv_heads():
    def build(backend, tp):
        model = CausalLM(HYBRID8, rngs=nnx.Rngs(3), kernels=kernels(backend, tp))
        shard_model(model)
        return model

    want = steps(build("xla", 1))
    assert_same(steps(build("xla", 8)), want, "hybrid8 xla tp=8")
    assert_same(steps(build("pallas", 4)), want, "hybrid8 pallas tp=4")
    model = build("xla", 8)
    assert model.layers[1].mixer.kv_repeat == 4
    assert model.layers[1].mixer.k_proj.kernel[...].sharding.is_fully_replicated
    assert not model.layers[1].mixer.q_proj.kernel[...].sharding.is_fully_replicated


def test_undividable_sizes_are_refused():
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of 8"):
        check_tp(preset_config("tiny"), 8)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide or be divided by 2"):
        check_tp(ModelConfig("x", 64, 64, 128, ("attention",), num_heads=6, num_kv_heads=3, head_dim=8), 2)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(16)
