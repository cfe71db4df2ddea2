"""The multi-token-prediction blocks of DeepSeek V3 / V3.2, GLM-5 and Qwen3-Next / Qwen3.5
(``models/layers/mtp_nextn.py``): a tiny transformers checkpoint plus one MTP block written
under the published names (DeepSeek: ``model.layers.<num_hidden_layers>.{enorm, hnorm,
eh_proj, shared_head.*, embed_tokens}`` and a decoder layer; Qwen: ``mtp.{fc,
pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layers.0.*}``) loads into
``model.mtp[0]``, and the block's logits equal a recomputation: its input mix in numpy from
the file's tensors, then a one-layer transformers model of the family holding the block's
layer, its norm and its head. Counts and refusals as for DeepSeek V4 (``test_mtp.py``)."""

from __future__ import annotations

import json
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hicache_jax.models import load_hf
from hicache_jax.models.hf.safetensors_io import CheckpointError
from hicache_jax.models.layers.mtp_nextn import block_config
from tests.hf_checkpoints import load_reference, make
from tests.models.steps import whole_sequence
from tests.models.test_fp8_blocks import QUANT, decode, quantize

FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5", "qwen3_5_moe")
# The main layer each block's layer is copied from: an MoE layer with full attention (GLM-5's
# layer 1 shares layer 0's picks; the Qwen stacks' layer 1 is their full-attention one).
SOURCE = {"deepseek_v3": 2, "deepseek_v32": 2, "glm_moe_dsa": 2} | dict.fromkeys(FAMILIES[3:], 1)
KEY = {"deepseek": "num_nextn_predict_layers", "qwen": "mtp_num_hidden_layers"}


def style(family: str) -> str:
    return "qwen" if family.startswith("qwen") else "deepseek"


def block_prefix(family: str, config: dict) -> tuple[str, str]:
    """(the block's own tensors' prefix, its layer's)."""
    if style(family) == "qwen":
        return "mtp.", "mtp.layers.0."
    pre = f"model.layers.{config['num_hidden_layers']}."
    return pre, pre


def mtp_tensors(family: str, tensors: dict, config: dict, seed: int = 0) -> dict:
    """One block under the published names: a main MoE layer's tensors moved by noise (no
    tensor equals its source), the input norms, projection and output norm (Qwen's norms
    scale by ``1 + w``), and DeepSeek's own head and copy of the embedding."""
    rng = np.random.default_rng(seed)
    own, layer = block_prefix(family, config)
    src = f"model.layers.{SOURCE[family]}."
    out = {}
    for name, t in tensors.items():
        if name.startswith(src):
            t = (t + rng.standard_normal(t.shape) * 0.05 * (np.abs(t).mean() + 1e-3)).astype(t.dtype)
            out[layer + name.removeprefix(src)] = t
    h, vocab = config["hidden_size"], config["vocab_size"]
    centre = 0.0 if style(family) == "qwen" else 1.0
    f32 = np.float32
    if style(family) == "qwen":
        names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "fc")
    else:
        names = ("enorm", "hnorm", "shared_head.norm", "eh_proj")
        out[own + "shared_head.head.weight"] = (rng.standard_normal((vocab, h)) * h**-0.5).astype(f32)
        out[own + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    for norm in names[:3]:
        out[f"{own}{norm}.weight"] = (centre + 0.3 * rng.standard_normal(h)).astype(f32)
    out[f"{own}{names[3]}.weight"] = (rng.standard_normal((h, 2 * h)) * (2 * h) ** -0.5).astype(f32)
    return out


def write(d, tensors: dict, config: dict) -> str:
    os.makedirs(d, exist_ok=True)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return str(d)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, path, tensors, config) of the family's tiny checkpoint with one MTP block."""
    family = request.param
    base = make(family, str(tmp_path_factory.mktemp(family)))
    tensors = load_file(os.path.join(base, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    tensors |= mtp_tensors(family, tensors, config)
    config |= {KEY[style(family)]: 1}
    path = write(tmp_path_factory.mktemp(f"{family}_mtp"), tensors, config)
    return family, path, tensors, config


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_hf(checkpoint[1], dtype="float32")


def run_block(model, hidden, ids):
    """The block over one sequence of ``len(ids)`` tokens from an empty one-layer cache."""
    cfg, block = model.cfg, model.mtp[0]
    one = block_config(cfg)
    assert one.layer_kinds == (block.kind,)
    entry, batch = whole_sequence(one, ids)
    _, out, logits = block(entry, jnp.asarray(hidden), batch, model.embed, model.unembed)
    return np.asarray(out), np.asarray(logits)


def rms(x, w, eps, offset):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w)


def reference_logits(family: str, tensors: dict, config: dict, hidden, ids) -> np.ndarray:
    """The input mix in float64 from the file's tensors (embedding first in the concat),
    then a one-layer transformers model of the family holding the block's layer as layer
    0, the block's output norm as its final norm and the block's head as its LM head."""
    import torch

    own, layer = block_prefix(family, config)
    qwen = style(family) == "qwen"
    eps, offset = config["rms_norm_eps"], 1.0 if qwen else 0.0
    en, hn, norm, proj = (
        ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "fc")
        if qwen
        else ("enorm", "hnorm", "shared_head.norm", "eh_proj")
    )
    w = {k: tensors[f"{own}{k}.weight"].astype(np.float64) for k in (en, hn, norm, proj)}
    embed = tensors["model.embed_tokens.weight"]
    e = rms(embed[ids].astype(np.float64), w[en], eps, offset)
    mixed = np.concatenate([e, rms(hidden.astype(np.float64), w[hn], eps, offset)], axis=-1) @ w[proj].T

    if qwen:
        one = dict(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
    else:
        one = dict(num_hidden_layers=1, first_k_dense_replace=0)
        per_layer = dict(
            layer_types=config.get("layer_types", [])[:1], indexer_types=["full"], mlp_layer_types=["sparse"]
        )
        one |= {k: v for k, v in per_layer.items() if config.get(k) is not None}
    state = {f"model.layers.0.{n.removeprefix(layer)}": v for n, v in tensors.items() if n.startswith(layer)}
    for k in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
        state.pop(f"model.layers.0.{k}.weight", None)
    state["model.embed_tokens.weight"] = embed
    state["model.norm.weight"] = tensors[f"{own}{norm}.weight"]
    state["lm_head.weight"] = tensors["lm_head.weight"] if qwen else tensors[f"{own}shared_head.head.weight"]
    with tempfile.TemporaryDirectory() as d:  # from_pretrained converts the per-expert names
        ref = load_reference(write(d, state, config | one | {KEY[style(family)]: 0}))
        assert sum(v.numel() for v in ref.state_dict().values()) == sum(v.size for v in state.values())
    given = torch.tensor(mixed[None], dtype=torch.float32)  # [1, T, h]
    hook = ref.model.layers[0].register_forward_pre_hook(
        lambda mod, args, kw: ((given, *args[1:]), kw), with_kwargs=True
    )
    try:
        with torch.no_grad():
            return ref(inputs_embeds=torch.zeros(1, len(ids), config["hidden_size"])).logits[0].numpy()
    finally:
        hook.remove()


def test_block_drafts_as_recomputed(checkpoint, model):
    """30 tokens through the block (DSA's indexer covering them all) against the reference;
    the block with its projection's two input halves swapped (the concat order reversed)
    does not match it."""
    family, _, tensors, config = checkpoint
    rng = np.random.default_rng(1)
    T, h = 30, config["hidden_size"]
    ids = rng.integers(0, config["vocab_size"], T)
    hidden = (rng.standard_normal((T, h)) * 2).astype(np.float32)
    want = reference_logits(family, tensors, config, hidden, ids)
    out, logits = run_block(model, hidden, ids)
    assert out.shape == (T, h)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)

    proj = model.mtp[0].proj.kernel
    kept = proj[...]
    proj[...] = jnp.concatenate([kept[h:], kept[:h]], axis=0)  # [2h, h]: hidden half first
    try:
        _, swapped = run_block(model, hidden, ids)
    finally:
        proj[...] = kept
    assert np.abs(swapped - want).max() > 1e-2


def test_every_mtp_tensor_is_in_the_block(checkpoint, model):
    family, _, tensors, config = checkpoint
    own, layer = block_prefix(family, config)
    block = model.mtp[0]
    kind = {"deepseek_v3": "mla", "deepseek_v32": "dsa", "glm_moe_dsa": "dsa"}.get(family, "attention")
    assert len(model.mtp) == 1 and block.kind == kind
    held = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(block, nnx.Param)))
    mtp = {n: v for n, v in tensors.items() if n.startswith(own) or n.startswith(layer)}
    copy = f"{own}embed_tokens.weight"  # DeepSeek's copy of the embedding: checked, not held
    assert held == sum(v.size for n, v in mtp.items() if n != copy)
    assert model.cfg.mtp_params() == held
    h = config["hidden_size"]
    eq = np.testing.assert_array_equal
    eq(block.proj.kernel[...], mtp[f"{own}{'fc' if style(family) == 'qwen' else 'eh_proj'}.weight"].T)
    eq(block.layer.input_norm.weight[...], mtp[f"{layer}input_layernorm.weight"])
    assert block.proj.kernel.shape == (2 * h, h)


def test_main_model_is_the_same_with_the_block(checkpoint, model, tmp_path):
    family, _, tensors, config = checkpoint
    own, layer = block_prefix(family, config)
    plain = {n: v for n, v in tensors.items() if not (n.startswith(own) or n.startswith(layer))}
    bare = load_hf(write(tmp_path, plain, config | {KEY[style(family)]: 0}), dtype="float32")
    assert bare.mtp is None
    ids = jnp.asarray(np.random.RandomState(0).randint(0, config["vocab_size"], (1, 24)))
    np.testing.assert_array_equal(model.forward_full(ids), bare.forward_full(ids))
    held = lambda m: sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert model.cfg.num_params() == held(bare) == sum(v.size for v in plain.values())
    assert held(model) == model.cfg.num_params() + model.cfg.mtp_params()


def test_missing_extra_or_uncounted_mtp_tensors(checkpoint, tmp_path):
    family, _, tensors, config = checkpoint
    own, layer = block_prefix(family, config)
    key = KEY[style(family)]
    gone = dict(tensors)
    proj = f"{own}{'fc' if style(family) == 'qwen' else 'eh_proj'}.weight"
    del gone[proj]
    with pytest.raises(CheckpointError, match=re.escape(proj)):
        load_hf(write(tmp_path / "missing", gone, config), dtype="float32")
    plain = {n: v for n, v in tensors.items() if not (n.startswith(own) or n.startswith(layer))}
    with pytest.raises(CheckpointError, match=f"{key} 1 but the checkpoint holds none.*set it to 0"):
        load_hf(write(tmp_path / "none", plain, config), dtype="float32")
    extra = dict(tensors) | {f"{layer}stray.weight": np.zeros(3, np.float32)}
    with pytest.raises(CheckpointError, match=re.escape(f"no parameter reads: {layer}stray.weight")):
        load_hf(write(tmp_path / "extra", extra, config), dtype="float32")
    if style(family) == "deepseek":  # a copy of the embedding that is not one
        other = dict(tensors)
        other[f"{own}embed_tokens.weight"] = other[f"{own}embed_tokens.weight"] + 1
        with pytest.raises(CheckpointError, match=r"embed_tokens\.weight differs from model\.embed_tokens"):
            load_hf(write(tmp_path / "embed", other, config), dtype="float32")


def test_fp8_block_loads_as_decoded(checkpoint, model, tmp_path):
    """The block's projections (its input projection, attention and expert Linears) as
    block-scaled FP8 with ``weight_scale_inv``: they load as the test decodes them, and the
    block drafts as from a float32 file holding the decoded values."""
    family, _, tensors, config = checkpoint
    own, layer = block_prefix(family, config)
    fp8, dense = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        mtp = name.startswith(own) or name.startswith(layer)
        if mtp and w.ndim == 2 and name.endswith(("proj.weight", "fc.weight")):
            q, s = quantize(w)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dense[name] = decode(q, s)
    quantized = load_hf(
        write(tmp_path / "fp8", fp8, config | {"quantization_config": QUANT}), dtype="float32"
    )
    decoded = load_hf(write(tmp_path / "dense", dense, config), dtype="float32")
    proj = f"{own}{'fc' if style(family) == 'qwen' else 'eh_proj'}.weight"
    assert proj + "_scale_inv" in fp8
    np.testing.assert_array_equal(quantized.mtp[0].proj.kernel[...], dense[proj].T)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, config["vocab_size"], 20)
    hidden = rng.standard_normal((20, config["hidden_size"])).astype(np.float32)
    for got, want in zip(run_block(quantized, hidden, ids), run_block(decoded, hidden, ids)):
        np.testing.assert_array_equal(got, want)


# One family per layer kind and head: the file stays short.
@pytest.mark.parametrize("checkpoint", ["deepseek_v3", "glm_moe_dsa", "qwen3_next"], indirect=True)
def test_block_splits_as_a_layer_under_tensor_parallelism(checkpoint, model):
    """At tp 2 the block's layer is split as a main layer's, DeepSeek's own head by
    vocabulary, the input projection replicated; its drafts are those at tp 1."""
    from jax.sharding import PartitionSpec as Spec

    from hicache_jax.models import KernelConfig
    from hicache_jax.models.sharding import make_mesh

    family, path, _, config = checkpoint
    rng = np.random.default_rng(2)
    ids = rng.integers(0, config["vocab_size"], 24)
    hidden = rng.standard_normal((24, config["hidden_size"])).astype(np.float32)
    want = run_block(model, hidden, ids)
    kernels = KernelConfig(attention="xla", mesh=make_mesh(2), moe="gathered")
    split = load_hf(path, dtype="float32", kernels=kernels)
    block = split.mtp[0]
    mixer = block.layer.mixer
    column = mixer.q_proj if getattr(mixer, "q_proj", None) is not None else mixer.q_b_proj
    assert column.kernel[...].sharding.spec == Spec(None, "tp")
    assert block.proj.kernel[...].sharding.is_fully_replicated
    if block.head is not None:
        assert block.head.kernel[...].sharding.spec == Spec(None, "tp")
    for got, ref in zip(run_block(split, hidden, ids), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
