"""Malformed checkpoints fail with an error naming the file and the tensor."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hicache_jax.models import CheckpointError, load_hf
from tests import hf_checkpoints

TENSOR = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture
def mistral_copy(checkpoint_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("mistral"), dst)
    return str(dst)


def rewrite(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)
    return f


def test_unsupported_architecture(mistral_copy):
    cfg_path = os.path.join(mistral_copy, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["FancyNetForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match=r"config\.json.*FancyNetForCausalLM.*not supported"):
        load_hf(mistral_copy)


def test_missing_config(mistral_copy):
    os.remove(os.path.join(mistral_copy, "config.json"))
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_hf(mistral_copy)


def test_missing_tensor(mistral_copy):
    f = rewrite(mistral_copy, lambda t: t.pop(TENSOR))
    with pytest.raises(CheckpointError, match=f"tensor {TENSOR} is missing") as e:
        load_hf(mistral_copy)
    assert mistral_copy in str(e.value) or f in str(e.value)


def test_wrong_shape(mistral_copy):
    def shrink(t):
        t[TENSOR] = t[TENSOR][:-1]

    f = rewrite(mistral_copy, shrink)
    with pytest.raises(
        CheckpointError, match=rf"{f}: tensor {TENSOR} has shape \(31, 64\), expected \(32, 64\)"
    ):
        load_hf(mistral_copy)


def test_wrong_dtype(mistral_copy):
    def to_int(t):
        t[TENSOR] = t[TENSOR].astype(np.int32)

    f = rewrite(mistral_copy, to_int)
    with pytest.raises(CheckpointError, match=rf"{f}: tensor {TENSOR} has dtype int32"):
        load_hf(mistral_copy)


def test_truncated_file(mistral_copy):
    f = os.path.join(mistral_copy, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{f}: tensor .* truncated"):
        load_hf(mistral_copy)


def test_garbage_file(mistral_copy):
    f = os.path.join(mistral_copy, "model.safetensors")
    open(f, "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match=rf"{f}: not a safetensors file"):
        load_hf(mistral_copy)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tmp_path, checkpoint_dir):
    path = hf_checkpoints.make("mistral", str(tmp_path / "sharded"), max_shard_size="60KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    ids = np.arange(30)[None]
    whole = load_hf(checkpoint_dir("mistral")).forward_full(ids)
    np.testing.assert_array_equal(np.asarray(load_hf(path).forward_full(ids)), np.asarray(whole))
    os.remove(os.path.join(path, shards[-1]))
    with pytest.raises(CheckpointError, match=shards[-1]):
        load_hf(path)


@pytest.mark.parametrize(
    "blocks,where",
    [
        ({"hybrid_override_pattern": "-M*-"}, r"'-M\*-'.*block '-' at 0"),  # starts with an MLP
        ({"hybrid_override_pattern": "M--*"}, r"'M--\*'.*block '-' at 2"),  # two MLPs in a row
        ({"hybrid_override_pattern": "M*EE"}, r"'M\*EE'.*block 'E' at 3"),
        # transformers 5 writes the blocks as a list:
        ({"layers_block_type": ["linear_attention", "mlp", "mlp"]}, r"'M--'.*block '-' at 2"),
    ],
)
def test_nemotron_h_mlp_block_without_a_mixer_is_refused(checkpoint_dir, tmp_path, blocks, where):
    """Our layers pair each MLP block with the mixer before it; an MLP block with none is
    refused, naming the pattern."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("nemotron_h"), dst)
    cfg_path = dst / "config.json"
    cfg = json.load(open(cfg_path))
    cfg.pop("layers_block_type")
    json.dump(cfg | blocks, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match=rf"config\.json: hybrid_override_pattern {where} follows no"):
        load_hf(str(dst))


def test_gated_deltanet_projection_of_wrong_shape_is_named(checkpoint_dir, tmp_path):
    """A GDN in-projection is read from four tensors and regrouped by key head: one of the
    wrong width is named with the shapes of all four, not left to fail in a reshape."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("qwen3_5"), dst)
    z = "model.layers.0.linear_attn.in_proj_z.weight"

    def shrink(t):
        t[z] = t[z][:-8]  # one value head fewer

    f = rewrite(str(dst), shrink)
    with pytest.raises(
        CheckpointError, match=rf"{f}: tensors .*in_proj_qkv.weight \(192, 64\).*{z} \(56, 64\)"
    ):
        load_hf(str(dst))
