"""GGUF files of every served family (written from random-weight transformers checkpoints as
llama.cpp lays them out) give transformers' logits; quantized tensors dequantize as
``gguf.quants`` does; a malformed file is a ``CheckpointError`` naming what is wrong.

transformers cannot read llama.cpp's ``granitehybrid`` (Bamba) files, so a Bamba GGUF is
checked against transformers running the checkpoint it was written from, and against this
package loading that checkpoint from safetensors.

Tolerance as in test_hf_parity: 2e-5 of the largest |logit| (observed ~1.5e-6 relative; for
Bamba ~3e-6, and 1.5e-6 between our two loads, which differ in SSD chunk size).
"""

import dataclasses
import math
import os

import jax
import numpy as np
import pytest
import torch

from hicache_jax.models import CheckpointError, load_hf
from hicache_jax.models.fingerprint import checkpoint_fingerprint
from hicache_jax.models.gguf.tensors import GGUFCheckpoint
from hicache_jax.models.tokenizer import Tokenizer
from tests import gguf_files


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    made = {}

    def make(family: str) -> str:
        if family not in made:
            path = str(tmp_path_factory.mktemp(f"gguf-{family}") / f"{family}.gguf")
            made[family] = gguf_files.write(gguf_files.hf_model(family), path)
        return made[family]

    return make


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_logits_match_transformers_reading_the_same_gguf(written, family):
    path = written(family)
    ids = np.random.RandomState(0).randint(0, 512, size=(2, 70))
    with torch.no_grad():
        want = gguf_files.load_reference(path)(torch.tensor(ids)).logits.numpy()
    model = load_hf(os.path.dirname(path))  # the folder holding one GGUF works as the file does
    got = np.asarray(jax.jit(model.forward_full)(ids))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_bamba_logprobs_match_transformers_on_the_source_checkpoint(written, checkpoint_dir):
    """hf_model("bamba") is the checkpoint checkpoint_dir("bamba") saves (same seed)."""
    path = written("bamba")
    ids = np.random.RandomState(0).randint(0, 512, size=(2, 70))
    with torch.no_grad():
        want = torch.log_softmax(gguf_files.hf_model("bamba")(torch.tensor(ids)).logits, -1).numpy()
    ours = {}
    for source in (path, checkpoint_dir("bamba")):
        logits = jax.jit(load_hf(source).forward_full)(ids)
        ours[source] = np.asarray(jax.nn.log_softmax(logits, -1))
    tol = 2e-5 * np.abs(want).max()
    np.testing.assert_allclose(ours[path], want, rtol=0, atol=tol)
    np.testing.assert_allclose(ours[path], ours[checkpoint_dir("bamba")], rtol=0, atol=tol)


def test_bamba_config_and_weights_equal_the_safetensors_ones(written, checkpoint_dir):
    from hicache_jax.models.hf.safetensors_io import Checkpoint

    path = written("bamba")
    got, want = load_hf(path).cfg, load_hf(checkpoint_dir("bamba")).cfg
    # Not in GGUF: the SSD chunk size (256, transformers' default); eps is stored as float32.
    assert got.mamba.chunk_size == 256 and math.isclose(got.rms_norm_eps, want.rms_norm_eps, rel_tol=1e-7)
    mamba = dataclasses.replace(got.mamba, chunk_size=want.mamba.chunk_size)
    assert dataclasses.replace(got, mamba=mamba, rms_norm_eps=want.rms_norm_eps) == want
    assert got.layer_kinds == ("mamba", "attention", "mamba") and got.rotary_dim == 8
    gguf, st = GGUFCheckpoint(path), Checkpoint(checkpoint_dir("bamba"))
    assert sorted(gguf.names()) == sorted(st.names())
    for name in st.names():  # A_log goes through -exp and back: a float32 rounding apart
        np.testing.assert_allclose(gguf.get(name), st.get(name), rtol=1e-6, atol=0, err_msg=name)
    assert not Tokenizer(path).has_text  # the shared tokenizer path: no vocabulary written


def _expert_router(w):
    w.add_expert_count(4)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 64), np.float32))


def _attention_bias(w):
    w.add_tensor("blk.1.attn_q.bias", np.zeros(64, np.float32))


@pytest.mark.parametrize(
    "edit, match",
    [
        (_expert_router, r"g\.gguf: granitehybrid mixture-of-experts layers \(blk\.0\.ffn_gate_inp\.weight"),
        (lambda w: w.add_embedding_scale(12.0), r"granitehybrid\.embedding_scale = 12 is not supported"),
        (lambda w: w.add_residual_scale(0.22), r"granitehybrid\.residual_scale = 0\.22 is not supported"),
        (lambda w: w.add_logit_scale(8.0), r"granitehybrid\.logit_scale = 8 is not supported"),
        (lambda w: w.add_attention_scale(0.0078125), r"attention\.scale = 0\.0078125 .* neutral 0\.25"),
        (lambda w: w.add_rope_scaling_finetuned(False), r"rope\.scaling\.finetuned is false"),
        (_attention_bias, r"granitehybrid tensors blk\.1\.attn_q\.bias are not part of Bamba"),
    ],
    ids=["moe", "embedding_scale", "residual_scale", "logit_scale", "attention_scale", "nope", "bias"],
)
def test_unsupported_granitehybrid_variants_are_named(tmp_path, edit, match):
    """Granite 4.0 hybrids share the architecture (MoE, Granite multipliers, no RoPE), and a
    tensor Bamba has no place for is not dropped silently."""
    path = gguf_files.write(gguf_files.hf_model("bamba"), str(tmp_path / "g.gguf"), edit=edit)
    with pytest.raises(CheckpointError, match=match):
        load_hf(path)


def test_neutral_granite_multipliers_are_accepted(tmp_path):
    def neutral(w):
        w.add_embedding_scale(1.0)
        w.add_residual_scale(1.0)
        w.add_logit_scale(1.0)
        w.add_attention_scale(16**-0.5)

    path = gguf_files.write(gguf_files.hf_model("bamba"), str(tmp_path / "n.gguf"), edit=neutral)
    assert GGUFCheckpoint(path).hf["architectures"] == ["BambaForCausalLM"]


def test_config_from_metadata(written):
    gemma = load_hf(written("gemma3")).cfg
    assert gemma.layer_kinds == ("sliding",) * 5 + ("attention",)
    assert gemma.sliding_window == 20 and gemma.head_dim == 256 and gemma.tie_word_embeddings
    assert gemma.rope_base("sliding") == 1e4 and gemma.rope_base("attention") == 1e6
    llama = load_hf(written("llama")).cfg
    assert llama.architecture == "LlamaForCausalLM" and not llama.tie_word_embeddings
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 1, 16)


def test_fingerprint_covers_the_file_bytes(written, tmp_path):
    path = written("llama")
    copy = tmp_path / "copy.gguf"
    data = bytearray(open(path, "rb").read())
    copy.write_bytes(data)
    assert checkpoint_fingerprint(str(copy)) == checkpoint_fingerprint(str(tmp_path))
    data[-3] ^= 1  # one bit of the last weight
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "copy.gguf").write_bytes(data)
    assert checkpoint_fingerprint(str(tmp_path / "other")) != checkpoint_fingerprint(str(copy))


def test_without_a_vocabulary_the_tokenizer_is_ids_only(written):
    assert not Tokenizer(written("llama")).has_text


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16"])
def test_quantized_tensors_dequantize_as_gguf_quants(tmp_path, qtype):
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    model = gguf_files.hf_model("llama")
    path = gguf_files.write(model, str(tmp_path / "q.gguf"), types={"blk.0.ffn_up.weight": q})
    want = model.state_dict()["model.layers.0.mlp.up_proj.weight"].numpy()
    roundtrip = gguf.quants.dequantize(gguf.quants.quantize(want, q), q)
    got = GGUFCheckpoint(path).get("model.layers.0.mlp.up_proj.weight")
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, roundtrip)
    assert np.abs(got - want).max() < 0.2 * np.abs(want).max()  # and near the original


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_read_with_their_block_layout(tmp_path, qtype):
    """No numpy quantizer for K-quants: random blocks (with small, finite fp16 scales), read
    back in Hugging Face's shape and equal to gguf.quants' dequantization."""
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[q]
    rows, cols = 8, 2 * block
    raw = np.random.RandomState(0).randint(0, 256, size=(rows, cols // block * nbytes)).astype(np.uint8)
    blocks = raw.reshape(-1, nbytes)
    scale = np.float16(0.01).view(np.uint16)
    blocks[:, -2:] = np.frombuffer(np.array([scale], np.uint16).tobytes(), np.uint8)  # d (last for Q6_K)
    if q != gguf.GGMLQuantizationType.Q6_K:
        blocks[:, :4] = np.frombuffer(np.array([scale, scale], np.uint16).tobytes(), np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(tmp_path / "k.gguf"))
    from hicache_jax.models.gguf.tensors import dequantize

    got = dequantize(reader.tensors[0], "k.gguf")
    want = gguf.quants.dequantize(raw, q)
    assert got.shape == (rows, cols)
    np.testing.assert_array_equal(got, want.reshape(rows, cols))


def test_unsupported_quantization_names_tensor_and_type(tmp_path):
    import gguf

    q = gguf.GGMLQuantizationType.IQ2_XXS
    block, nbytes = gguf.GGML_QUANT_SIZES[q]
    w = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((128, 64 // block * nbytes), np.uint8), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from hicache_jax.models.gguf.tensors import dequantize

    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight has quantization IQ2_XXS"):
        dequantize(gguf.GGUFReader(str(tmp_path / "iq2.gguf")).tensors[0], "iq2.gguf")


def test_missing_tensor_is_named(tmp_path):
    path = gguf_files.write(
        gguf_files.hf_model("llama"), str(tmp_path / "m.gguf"), drop=("blk.1.ffn_up.weight",)
    )
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor blk\.1\.ffn_up\.weight .* is missing"):
        load_hf(path)


def test_unknown_architecture_is_named(tmp_path):
    path = gguf_files.write(gguf_files.hf_model("llama"), str(tmp_path / "a.gguf"), arch="falcon")
    with pytest.raises(CheckpointError, match=r"a\.gguf: GGUF architecture 'falcon' is not supported"):
        load_hf(path)


def test_truncated_file_is_named(written, tmp_path):
    data = open(written("llama"), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: not a readable GGUF file"):
        load_hf(str(cut))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(CheckpointError, match=r"junk\.gguf: not a readable GGUF file"):
        load_hf(str(tmp_path / "junk.gguf"))
