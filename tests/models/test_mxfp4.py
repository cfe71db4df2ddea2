"""MXFP4 expert weights (gpt-oss's published format): a checkpoint written by the format's
rules from random bytes loads dequantized and gives transformers' logits for the same file;
the decoding matches one written here bit by bit; malformed blocks or scales are refused."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from hicache_jax.models import load_hf
from hicache_jax.models.hf import mxfp4
from hicache_jax.models.hf.safetensors_io import CheckpointError
from tests.hf_checkpoints import hf_model, load_reference
from tests.xla_env import SERVING_COMPILE


def e2m1(code: int) -> float:
    """One FP4 code from its bits: sign, two exponent bits (bias 1), one mantissa bit."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def test_dequantize_matches_bit_level_decoding():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 135, (3, 5, 2), dtype=np.uint8)
    want = np.zeros((3, 5, 64), np.float64)
    for idx in np.ndindex(blocks.shape):
        *lead, g, byte = idx
        value = int(blocks[idx])
        scale = 2.0 ** (int(scales[(*lead, g)]) - 127)
        want[(*lead, g * 32 + 2 * byte)] = e2m1(value & 0xF) * scale  # low nibble: even element
        want[(*lead, g * 32 + 2 * byte + 1)] = e2m1(value >> 4) * scale
    np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), want.astype(np.float32))


def write_mxfp4(out_dir: str, seed: int = 0, corrupt=None) -> str:
    """A gpt-oss checkpoint whose expert projections are MXFP4: random bytes for the blocks,
    scales around 2**0, stored as the published checkpoints are ([E, out, in / 32, 16])."""
    hf_model("gpt_oss", seed).save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    rng = np.random.default_rng(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, cols, rows = tensors.pop(name).shape  # bf16/f32 checkpoints hold [E, in, out]
        tensors[name + "_blocks"] = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(124, 130, (E, rows, cols // 32), dtype=np.uint8)
    if corrupt:
        corrupt(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def test_mxfp4_checkpoint_gives_transformers_logits(tmp_path):
    path = write_mxfp4(str(tmp_path))
    ids = np.random.RandomState(0).randint(0, 512, size=(2, 50))
    with torch.no_grad():
        want = load_reference(path)(torch.tensor(ids)).logits.numpy()  # dequantized on CPU
    model = load_hf(path)
    # Compiled as a server compiles it: the suite's cheap XLA:CPU flags (tests/xla_env.py)
    # skip LLVM's optimisations, which moves float32 rounding by about this tolerance (one
    # logit of 51,200 off by 2.2e-5 of the largest seen in a suite run).
    forward = jax.jit(model.forward_full).lower(ids).compile(compiler_options=SERVING_COMPILE)
    got = np.asarray(forward(ids))
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-5 * np.abs(want).max())
    # The values are the format's: every expert weight is a code times a power of two.
    gate_up = np.asarray(model.layers[0].mlp.gate_up[...])
    assert np.isin(np.abs(gate_up) / 2.0 ** np.floor(np.log2(np.abs(gate_up) + 1e-30)), [0, 1, 1.5]).all()


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (
            lambda t: t.update({k: t[k][..., :-1] for k in t if k.endswith("down_proj_scales")}),
            "do not match",
        ),
        (
            lambda t: t.update({k: t[k].astype(np.int16) for k in t if k.endswith("gate_up_proj_blocks")}),
            "uint8",
        ),
        (lambda t: t.update({k: t[k][:-1] for k in t if k.endswith("down_proj_blocks")}), "experts first"),
    ],
    ids=["scales-short", "blocks-int16", "expert-missing"],
)
def test_malformed_mxfp4_is_refused(tmp_path, corrupt, match):
    path = write_mxfp4(str(tmp_path), corrupt=corrupt)
    with pytest.raises(CheckpointError, match=match):
        load_hf(path)
