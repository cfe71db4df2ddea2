"""GGUF files of every served family (written from random-weight transformers checkpoints as
llama.cpp lays them out) give transformers' logits; quantized tensors dequantize as
``gguf.quants`` does; a malformed file is a ``CheckpointError`` naming what is wrong.

Tolerance as in test_hf_parity: 2e-5 of the largest |logit| (observed ~1.5e-6 relative).
"""

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
