"""DeepSeek V4's multi-token-prediction block (``models/layers/mtp.py``): a tiny checkpoint
with an MTP block written under the published names (``mtp.0.*``) loads into
``model.mtp[0]``, and the block's drafts equal a recomputation: its input mix in numpy from
the file's tensors, its decoder layer, head and norm by transformers' own V4 modules (a
one-layer transformers model holding the block's weights, fed the mixed streams). The main
model's logits do not change with the block beside them; a config that counts blocks the
checkpoint lacks, or one that counts fewer than it holds, is refused with the tensors named."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hicache_jax.models import load_hf
from hicache_jax.models.hf.safetensors_io import CheckpointError
from tests.hf_checkpoints import load_reference, make
from tests.models.steps import whole_sequence


def mtp_tensors(tensors: dict, seed: int = 0) -> dict:
    """Block 0 of a tiny V4 transformers checkpoint's MTP, under the published names: layer
    0's attention (a sliding layer), layer 1's MoE (score-routed), norms and
    hyper-connections, each moved by noise so that no tensor equals its source, and the
    block's own enorm, hnorm, e_proj, h_proj, norm and hc_head."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.0.attn."):
            rest = name.removeprefix("model.layers.0.").replace("attn.norm.", "attn.kv_norm.")
        elif name.startswith("model.layers.1.") and ".attn." not in name:
            rest = name.removeprefix("model.layers.1.")
        else:
            continue
        if np.issubdtype(t.dtype, np.floating):
            t = (t + rng.standard_normal(t.shape) * 0.02 * (np.abs(t).mean() + 1e-3)).astype(t.dtype)
        out[f"mtp.0.{rest}"] = t
    h = tensors["model.embed_tokens.weight"].shape[1]
    n = tensors["model.hc_head.hc_fn"].shape[0]
    f32 = np.float32
    for norm in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{norm}.weight"] = (1 + 0.2 * rng.standard_normal(h)).astype(f32)
    for proj in ("e_proj", "h_proj"):
        out[f"mtp.0.{proj}.weight"] = (rng.standard_normal((h, h)) * h**-0.5).astype(f32)
    out["mtp.0.hc_head_fn"] = (rng.standard_normal((n, n * h)) * 0.05).astype(f32)
    out["mtp.0.hc_head_base"] = (rng.standard_normal(n) * 0.5).astype(f32)
    out["mtp.0.hc_head_scale"] = np.full((1,), 1.5, f32)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny V4 transformers checkpoint plus one MTP block (float32), its config counting
    it; its tensors and config."""
    base = make("deepseek_v4", str(tmp_path_factory.mktemp("v4")))
    tensors = load_file(os.path.join(base, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    tensors |= mtp_tensors(tensors)
    return write(tmp_path_factory.mktemp("v4_mtp"), tensors, config | {"num_nextn_predict_layers": 1})


def write(d, tensors: dict, config: dict) -> tuple[str, dict, dict]:
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return str(d), tensors, config


def test_every_mtp_tensor_is_in_the_block(checkpoint):
    path, tensors, _ = checkpoint
    model = load_hf(path, dtype="float32")
    assert len(model.mtp) == 1 and model.mtp[0].kind == "swa_mqa"
    block = model.mtp[0]
    t = {n.removeprefix("mtp.0."): v for n, v in tensors.items() if n.startswith("mtp.0.")}
    eq = np.testing.assert_array_equal
    eq(block.e_proj.kernel[...], t["e_proj.weight"].T)
    eq(block.h_proj.kernel[...], t["h_proj.weight"].T)
    for norm in ("enorm", "hnorm", "norm"):
        eq(getattr(block, norm).weight[...], t[f"{norm}.weight"])
    for ours, file in (("hc_fn", "hc_head_fn"), ("hc_base", "hc_head_base"), ("hc_scale", "hc_head_scale")):
        eq(getattr(block.head, ours)[...], t[file])
    layer = block.layer
    eq(layer.mixer.q_a_proj.kernel[...], t["attn.wq_a.weight"].T)
    eq(layer.mixer.kv_norm.weight[...], t["attn.kv_norm.weight"])
    eq(layer.mixer.sinks[...], t["attn.attn_sink"])
    eq(layer.input_norm.weight[...], t["attn_norm.weight"])
    eq(layer.attn_hc.fn[...], t["hc_attn_fn"])
    eq(layer.ffn_hc.base[...], t["hc_ffn_base"])
    eq(layer.mlp.score_correction_bias[...], t["ffn.gate.bias"])
    eq(layer.mlp.router.kernel[...], t["ffn.gate.weight"].T)
    eq(layer.mlp.down[...][1], t["ffn.experts.1.w2.weight"].T)
    eq(layer.mlp.shared_expert.up_proj.kernel[...], t["ffn.shared_experts.w3.weight"].T)
    # Every parameter of the block is one of the file's MTP tensors (the loader refuses a
    # file with a tensor nothing reads, so all of them were placed).
    held = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(block, nnx.Param)))
    assert held == sum(v.size for v in t.values())
    assert model.cfg.mtp_params() == held


def test_main_logits_are_the_same_with_the_block(checkpoint, tmp_path):
    path, tensors, config = checkpoint
    plain = {n: v for n, v in tensors.items() if not n.startswith("mtp.")}
    bare, _, _ = write(tmp_path, plain, config | {"num_nextn_predict_layers": 0})
    ids = jnp.asarray(np.random.RandomState(0).randint(0, config["vocab_size"], (1, 40)))
    with_mtp, without = load_hf(path, dtype="float32"), load_hf(bare, dtype="float32")
    assert without.mtp is None
    np.testing.assert_array_equal(with_mtp.forward_full(ids), without.forward_full(ids))
    held = lambda m: sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    # Counted as transformers counts (its model, whose state_dict the file's other tensors
    # are, has no MTP module): the blocks apart.
    transformers_state = sum(v.size for n, v in tensors.items() if not n.startswith("mtp."))
    assert with_mtp.cfg.num_params() == held(without) == transformers_state
    assert held(with_mtp) == with_mtp.cfg.num_params() + with_mtp.cfg.mtp_params()
    assert with_mtp.cfg.active_params() == without.cfg.active_params()


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def run_block(model, streams, ids):
    """The block over one sequence of ``len(ids)`` tokens from an empty cache of its own."""
    cfg, block = model.cfg, model.mtp[0]
    one = dataclasses.replace(
        cfg, layer_kinds=(block.kind,), sparse_layers=(0,), dsv4=dataclasses.replace(cfg.dsv4, hash_layers=())
    )
    entry, batch = whole_sequence(one, ids)
    _, out, logits = block(entry, jnp.asarray(streams), batch, model.embed, model.unembed)
    return np.asarray(out), np.asarray(logits)


def test_block_drafts_as_recomputed(checkpoint, tmp_path):
    """Input mix by hand, then transformers' layer (sliding window 20 over 40 tokens, a
    score-routed MoE), hc_head, norm and LM head holding the block's tensors."""
    import torch

    path, tensors, config = checkpoint
    model = load_hf(path, dtype="float32")
    rng = np.random.default_rng(1)
    T, n, h, eps = 40, config["hc_mult"], config["hidden_size"], config["rms_norm_eps"]
    ids = rng.integers(0, config["vocab_size"], T)
    streams = rng.standard_normal((T, n, h)).astype(np.float32)
    t = {
        k: v.astype(np.float64) for k, v in tensors.items() if k.startswith("mtp.0.") and v.dtype.kind == "f"
    }
    e = rms(tensors["model.embed_tokens.weight"][ids].astype(np.float64), t["mtp.0.enorm.weight"], eps)
    mixed = (e @ t["mtp.0.e_proj.weight"].T)[:, None, :]
    mixed = mixed + rms(streams.astype(np.float64), t["mtp.0.hnorm.weight"], eps) @ t["mtp.0.h_proj.weight"].T

    # A one-layer transformers V4 model holding the block: its layer the block's layer, its
    # hc_head and final norm the block's, embedding and LM head the model's.
    ref = {n.replace("mtp.0.", "model.layers.0.").replace("attn.kv_norm.", "attn.norm."): v
           for n, v in tensors.items() if n.startswith("mtp.0.")}  # fmt: skip
    for k in ("enorm", "hnorm", "e_proj", "h_proj", "norm"):
        ref.pop(f"model.layers.0.{k}.weight")
    ref["model.norm.weight"] = tensors["mtp.0.norm.weight"]
    for p in ("fn", "base", "scale"):
        ref[f"model.hc_head.hc_{p}"] = ref.pop(f"model.layers.0.hc_head_{p}")
    ref["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    ref["head.weight"] = tensors["head.weight"]
    one = {"num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]}
    ref_dir, _, _ = write(tmp_path, ref, config | one | {"num_nextn_predict_layers": 0})
    reference = load_reference(ref_dir)
    layer = reference.model.layers[0]
    given = torch.tensor(mixed[None], dtype=torch.float32)  # [1, T, n, h]
    hook = layer.register_forward_pre_hook(lambda mod, args, kw: ((given, *args[1:]), kw), with_kwargs=True)
    try:
        with torch.no_grad():
            want = reference(inputs_embeds=torch.zeros(1, T, h)).logits[0].numpy()
    finally:
        hook.remove()

    out, logits = run_block(model, streams, ids)
    assert out.shape == (T, n, h)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)


def test_missing_or_extra_mtp_tensors_are_named(checkpoint, tmp_path):
    _, tensors, config = checkpoint
    gone = dict(tensors)
    del gone["mtp.0.h_proj.weight"]
    os.makedirs(tmp_path / "missing")
    d, _, _ = write(tmp_path / "missing", gone, config)
    with pytest.raises(CheckpointError, match=r"mtp\.0\.h_proj\.weight"):
        load_hf(d, dtype="float32")
    os.makedirs(tmp_path / "uncounted")
    d, _, _ = write(tmp_path / "uncounted", tensors, config | {"num_nextn_predict_layers": 0})
    with pytest.raises(CheckpointError, match=r"no parameter reads: mtp\.0\..*num_nextn_predict_layers 0"):
        load_hf(d, dtype="float32")
    os.makedirs(tmp_path / "none")
    plain = {n: v for n, v in tensors.items() if not n.startswith("mtp.")}
    d, _, _ = write(tmp_path / "none", plain, config)
    with pytest.raises(CheckpointError, match="holds no mtp.* tensor.*set it to 0"):
        load_hf(d, dtype="float32")


def test_block_splits_as_a_layer_under_tensor_parallelism(checkpoint):
    """At tp 2 the block's layer is split as a main layer (queries by head, experts whole
    per device), the rest replicated, and its drafts are those at tp 1."""
    from jax.sharding import PartitionSpec as Spec

    from hicache_jax.models import KernelConfig
    from hicache_jax.models.sharding import make_mesh

    path, _, config = checkpoint
    rng = np.random.default_rng(2)
    ids = rng.integers(0, config["vocab_size"], 24)
    streams = rng.standard_normal((24, config["hc_mult"], config["hidden_size"])).astype(np.float32)
    want = run_block(load_hf(path, dtype="float32"), streams, ids)
    model = load_hf(
        path, dtype="float32", kernels=KernelConfig(attention="xla", mesh=make_mesh(2), moe="gathered")
    )
    block = model.mtp[0]
    assert block.layer.mixer.q_b_proj.kernel[...].sharding.spec == Spec(None, "tp")
    assert block.layer.mlp.gate_up[...].sharding.spec[0] == "tp"
    assert block.e_proj.kernel[...].sharding.is_fully_replicated
    for got, ref in zip(run_block(model, streams, ids), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
