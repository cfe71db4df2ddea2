"""Tensor parallelism on the 8 emulated CPU devices: every family gives the logits (within
1e-4, float32) and greedy tokens of the ``xla`` backend at ``tp_size=1`` with Pallas (in
interpret mode) at ``tp_size=1`` and with both backends split over the mesh, over chunked
prefill, a mixed step and decode steps. Pallas at ``tp_size=1`` is the kernels-against-
references check of ``models/kernels``. Split, each family runs one backend at 2 and the
other at 4, the pairs alternating between families (``SPLITS``), so each backend runs at
each size on several families, attention-only and hybrid alike. The HF families have 4 query
heads, so ``tp_size=8`` runs on a model built here with 8 (and its 2 KV heads replicated 4
times).

Costs are compiles (two programs per model, backend and size; Pallas interpret mode the
most), so each family runs its sizes in a row against one reference."""

import dataclasses
import importlib.util

import jax
import numpy as np
import pytest
from flax import nnx

from hicache_jax.models import CausalLM, KernelConfig, ModelConfig, load_hf
from hicache_jax.models.config import MoEConfig
from hicache_jax.models.presets import preset_config
from hicache_jax.models.sharding import check_tp, make_mesh, shard_model
from tests.models.steps import build_step, jit_forward, kv_groups, logits_of, sequence

P = 16
ATOL = 1e-4

HEADS8 = ModelConfig(
    architecture="test:heads8",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    layer_kinds=("sliding", "attention"),
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    sliding_window=20,
)


def steps(model):
    """Seq A prefills 10 tokens beside B's 9; then A's next 10 (a chunked prefill) beside
    B's first decode (a mixed step); then both decode. Returns each step's logits."""
    params, step = jit_forward(model)
    cache = model.allocate_cache(num_pages=8, page_size=P, num_state_slots=2, fill=np.nan)
    rng = np.random.RandomState(0)
    a = sequence(rng.randint(0, 512, 21), pages=[1, 2], state_slot=0)
    b = sequence(rng.randint(0, 512, 11), pages=[5], state_slot=1)
    out = []
    plan = (((10, 0), (9, 0)), ((10, 10), (1, 9)), ((1, 20), (1, 10)))
    for (na, ca), (nb, cb) in plan:
        work = [(a, ca, ca + na), (b, cb, cb + nb)]
        decode = na == nb == 1
        batch, rows = build_step(
            work,
            groups=kv_groups(model),
            page_size=P,
            max_pages=2,
            num_tokens=None if decode else 24,
            all_logits=True,  # every prefill position, not only each sequence's last
        )
        cache, logits = step(params, cache, batch)
        out.append(logits_of(logits, rows))
    return out


def assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=ATOL, err_msg=f"{what}, step {i}")
        # Greedy: the same token, unless the reference's top two are a near-tie.
        top2 = np.sort(w, axis=-1)[:, -2:]
        differ = g.argmax(-1) != w.argmax(-1)
        assert not (differ & (top2[:, 1] - top2[:, 0] > ATOL)).any(), f"{what}, step {i}: greedy differs"


# The Gated DeltaNet Pallas kernels land on their own branch; until they do, GDN families
# run the xla GDN kernel beside Pallas attention in their "pallas" runs.
GDN_PALLAS = importlib.util.find_spec("hicache_jax.models.kernels.gated_delta_rule.kernel") is not None
GDN_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


def kernels(backend, tp, family=None):
    # MoE: the TPU's grouped path beside the Pallas kernels, CPU's gathered one beside xla.
    moe = "grouped" if backend == "pallas" else "gathered"
    ssd = "xla" if family in GDN_FAMILIES and not GDN_PALLAS else backend
    return KernelConfig(
        attention=backend, ssd=ssd, interpret=True, mesh=make_mesh(tp) if tp > 1 else None, moe=moe
    )


SPLITS = {  # family -> its (backend, tp_size) runs split over the mesh
    "mistral": [("pallas", 2), ("xla", 4)],
    "gemma3": [("xla", 2), ("pallas", 4)],
    "bamba": [("xla", 2), ("pallas", 4)],
    "llama": [("pallas", 2), ("xla", 4)],
    "qwen3_moe": [("xla", 2), ("pallas", 4)],  # 8 experts: 4, then 2 on each device
    "olmo3": [("pallas", 2), ("xla", 4)],  # q/k norms over projections split by head
    "gpt_oss": [("xla", 2), ("pallas", 4)],  # sinks split with their heads, experts with biases
    # The MoE checkpoints of the Mamba2 hybrids hold their dense ones' layers too (Nemotron-H's
    # "ME*EMM-": MLP-free layers, an ungated MLP, no RoPE; Granite's multipliers), so only
    # they run here (the dense ones cost 4 minutes of compiles more).
    "nemotron_h_moe": [("xla", 2), ("pallas", 4)],  # a shared expert split as a dense MLP is
    "granite_h_moe": [("pallas", 2), ("xla", 4)],
    "qwen3_5": [("pallas", 2), ("xla", 4)],  # GDN key-head groups (4) split 2 and 1 per device
    "qwen3_next": [("xla", 2), ("pallas", 4)],  # fused GDN projections regrouped; a dense layer
    "qwen3_5_moe": [("pallas", 2), ("xla", 4)],  # a gated shared expert split as a dense MLP is
    # MLA heads split, the latent and indexer pages replicated; grouped routing, a shared expert.
    "deepseek_v3": [("xla", 2), ("pallas", 4)],
    "glm_moe_dsa": [("pallas", 2), ("xla", 4)],
    # One K=V head and its pages replicated, queries and sinks split by head, o_a by group (2:
    # at tp 4 replicated, each group's rows split over 2 devices); 4 experts, a hash layer.
    "deepseek_v4": [("xla", 2), ("pallas", 4)],
}


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    """``reference(family)``: the family's steps with the ``xla`` backend at ``tp_size=1``,
    run once per worker (DeepSeek V4's serves its query-block test too)."""
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = steps(load_hf(checkpoint_dir(family), kernels=kernels("xla", 1)))
        return made[family]

    return get


@pytest.mark.parametrize("family", list(SPLITS))
def test_families_match_tp1(checkpoint_dir, reference, family):
    path = checkpoint_dir(family)
    want = reference(family)
    for backend, tp in [("pallas", 1), *SPLITS[family]]:
        got = steps(load_hf(path, kernels=kernels(backend, tp, family)))
        assert not any(np.isnan(g).any() for g in got), f"{family} {backend} tp={tp}"
        assert_same(got, want, f"{family} {backend} tp={tp}")
        if tp == 1:  # the kernels against their references: relative to the logits' scale
            for i, (g, w) in enumerate(zip(got, want)):
                np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * np.abs(w).max(), err_msg=f"step {i}")


def test_tp8_with_replicated_kv_heads():
    def build(tp, backend):
        model = CausalLM(HEADS8, rngs=nnx.Rngs(3), kernels=kernels(backend, tp))
        shard_model(model)
        return model

    want = steps(build(1, "xla"))
    assert_same(steps(build(8, "pallas")), want, "8 heads, pallas tp=8")
    model = build(8, "xla")
    assert_same(steps(model), want, "8 heads, xla tp=8")
    assert model.layers[0].mixer.kv_repeat == 4
    assert model.layers[0].mixer.k_proj.kernel[...].sharding.is_fully_replicated
    assert not model.layers[0].mixer.q_proj.kernel[...].sharding.is_fully_replicated


def test_undividable_sizes_are_refused():
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of 8"):
        check_tp(preset_config("tiny"), 8)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide or be divided by 2"):
        check_tp(ModelConfig("x", 64, 64, 128, ("attention",), num_heads=6, num_kv_heads=3, head_dim=8), 2)
    check_tp(preset_config("tiny-qwen3.5"), 2)
    with pytest.raises(ValueError, match=r"gdn.num_k_heads=2 is not a multiple of 4"):  # whole groups
        check_tp(preset_config("tiny-qwen3.5"), 4)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(16)
    moe = preset_config("tiny")
    moe = ModelConfig(
        **{**moe.__dict__, "moe": MoEConfig(num_experts=6, top_k=2, intermediate=32), "sparse_layers": (0,)}
    )
    check_tp(moe, 2)
    with pytest.raises(
        ValueError, match=r"moe.num_experts=6 is not a multiple of 4"
    ):  # and 8: fewer than devices
        check_tp(moe, 4)
    v4 = preset_config("tiny-dsv4")  # 4 heads in 2 output groups, 4 experts
    check_tp(v4, 4)  # more devices than groups: each group's rows over 2
    with pytest.raises(ValueError, match=r"num_heads=4 is not a multiple of 8"):
        check_tp(v4, 8)
    six = dataclasses.replace(v4, num_heads=6, dsv4=dataclasses.replace(v4.dsv4, o_groups=3))
    with pytest.raises(ValueError, match=r"dsv4.o_groups=3 must divide or be divided by 2"):
        check_tp(six, 2)


def test_weights_load_into_their_shards(checkpoint_dir, tmp_path):
    """From safetensors and from orbax, at tp 2: each weight sits in its split, with the
    values of a one-device load."""
    from hicache_jax.models import load_model, orbax_io
    from hicache_jax.models.sharding import param_spec

    path = checkpoint_dir("mistral")
    whole = load_hf(path)
    orbax_io.save(whole, str(tmp_path / "orbax"))
    want = nnx.to_pure_dict(nnx.state(whole))
    for model in (
        load_hf(path, kernels=kernels("xla", 2)),
        load_model(str(tmp_path / "orbax"), kernels=kernels("xla", 2)),
    ):
        got = nnx.to_pure_dict(nnx.state(model))
        flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
        split = 0
        for kp, leaf in jax.tree_util.tree_leaves_with_path(got):
            path_ = tuple(getattr(k, "key", k) for k in kp)
            assert leaf.sharding.spec == param_spec(path_, leaf.shape, model.cfg, 2), path_
            split += not leaf.sharding.is_fully_replicated
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat_want[kp]), err_msg=str(path_))
        assert split >= 7 * 2  # q, k, v, o, gate, up, down in both layers


def test_experts_load_whole_onto_their_devices(checkpoint_dir):
    """At tp 4 each device holds 2 of the 8 experts, whole, with a one-device load's values."""
    path = checkpoint_dir("qwen3_moe")
    whole, split = load_hf(path), load_hf(path, kernels=kernels("xla", 4))
    for name in ("gate_up", "down"):
        want = np.asarray(getattr(whole.layers[0].mlp, name)[...])
        got = getattr(split.layers[0].mlp, name)[...]
        shards = sorted(got.addressable_shards, key=lambda sh: sh.index[0].start or 0)
        assert [sh.data.shape[0] for sh in shards] == [2] * 4, name
        for sh in shards:
            np.testing.assert_array_equal(np.asarray(sh.data), want[sh.index], err_msg=name)
    assert split.layers[0].mlp.router.kernel[...].sharding.is_fully_replicated


def test_shared_expert_splits_like_a_dense_mlp(checkpoint_dir):
    """At tp 2 Nemotron-H's shared expert is split by columns (up) and rows (down) while its
    routed experts are split whole and the router and its correction bias stay replicated;
    Granite's fused ``input_linear`` loads into split gate and up halves."""
    model = load_hf(checkpoint_dir("nemotron_h_moe"), kernels=kernels("xla", 2))
    mlp = model.layers[0].mlp
    assert mlp.shared_expert.up_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert mlp.shared_expert.down_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec("tp", None)
    assert mlp.gate_up[...].sharding.spec[0] == "tp"
    assert mlp.score_correction_bias[...].sharding.is_fully_replicated
    assert mlp.router.kernel[...].sharding.is_fully_replicated
    path = checkpoint_dir("granite_h_moe")
    whole, split = load_hf(path), load_hf(path, kernels=kernels("xla", 2))
    for name in ("gate_proj", "up_proj", "down_proj"):
        got = getattr(split.layers[1].mlp.shared_expert, name).kernel[...]
        assert not got.sharding.is_fully_replicated, name
        want = getattr(whole.layers[1].mlp.shared_expert, name).kernel[...]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def test_dsv4_splits_heads_and_groups(checkpoint_dir):
    """DeepSeek V4 at tp 2: queries and sinks split by head, o_a and o_b_proj by output group
    (2 groups), experts whole; the K=V projection, compressors, indexer, mHC mixes and
    tid2eid replicated. At tp 4 (more devices than groups) o_a and o_b_proj are replicated."""
    from jax.sharding import PartitionSpec as Spec

    path = checkpoint_dir("deepseek_v4")
    for tp, by_group in ((2, True), (4, False)):
        model = load_hf(path, kernels=kernels("xla", tp))
        layer = model.layers[1]  # a CSA layer: compressor and indexer
        attn = layer.mixer
        spec = lambda x: x[...].sharding.spec  # noqa: E731
        assert spec(attn.q_b_proj.kernel) == Spec(None, "tp")
        assert spec(attn.sinks) == Spec("tp")
        assert spec(attn.o_a) == (Spec("tp", None, None) if by_group else Spec())
        assert spec(attn.o_b_proj.kernel) == (Spec("tp", None) if by_group else Spec())
        assert spec(layer.mlp.gate_up)[0] == "tp"
        for name, x in [
            ("kv_proj", attn.kv_proj.kernel),
            ("compressor", attn.compressor.kv_proj.kernel),
            ("indexer", attn.indexer.gate_proj.kernel),
            ("index_q_b_proj", attn.index_q_b_proj.kernel),
            ("attn_hc", layer.attn_hc.fn),
            ("tid2eid", model.layers[0].mlp.tid2eid),
        ]:
            assert x[...].sharding.is_fully_replicated, (tp, name)


def test_dsv4_query_blocks_match(checkpoint_dir, reference, monkeypatch):
    """DeepSeek V4's attention in query blocks (``layers/dsv4.py``: ``jax.lax.map`` over
    blocks, the last padded) gives the logits of one block, at tp 1 and split at tp 2."""
    from hicache_jax.models.layers import dsv4

    path = checkpoint_dir("deepseek_v4")
    want = reference("deepseek_v4")  # at the default QUERY_BLOCK: one block a step
    # The 24-token steps: 2 blocks of 16 (the last half padding), 3 of 8.
    for tp, most in ((1, 16), (2, 8)):
        monkeypatch.setattr(dsv4, "QUERY_BLOCK", most)
        got = steps(load_hf(path, kernels=kernels("xla", tp)))
        assert_same(got, want, f"query blocks of at most {most}, tp={tp}")
