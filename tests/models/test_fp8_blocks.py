"""FP8 weights with 128x128 block scales (DeepSeek V3's published format): a tensor quantized
here by the format's rules, partial edge tiles included, dequantizes to what a decoder
written here from the E4M3 bit layout gives, bit for bit; a Llama checkpoint whose Linears
are rewritten that way loads to exactly those values and serves the prompt logprobs of the
same checkpoint holding them in float32; malformed scales and unsupported variants are
refused with the shapes or the setting named."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hicache_jax import LLM
from hicache_jax.models import load_hf
from hicache_jax.models.hf import fp8_blocks
from hicache_jax.models.hf.safetensors_io import CheckpointError, SafetensorsFile
from tests.hf_checkpoints import make
from tests.models.test_mtp import mtp_tensors

QUANT = dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128], activation_scheme="dynamic")
E4M3_MAX = 448.0


def e4m3(code: int) -> float:
    """One E4M3 ("fn") byte from its bits: sign, four exponent bits (bias 7), three mantissa
    bits; exponent 0 is subnormal; no infinities, 0x7f and 0xff are NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


DECODED = np.array([e4m3(c) for c in range(256)])  # float64, exact


def decode(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """The test's dequantization: each byte by the table above, times its tile's scale
    (``[i // 128, j // 128]``), the exact product rounded once to float32."""
    rows, cols = weight.shape
    i, j = np.arange(rows)[:, None] // 128, np.arange(cols)[None, :] // 128
    return (DECODED[weight.view(np.uint8)] * scale_inv[i, j].astype(np.float64)).astype(np.float32)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The format's rules (as DeepSeek's ``weight_quant``): per 128x128 tile, the scale maps
    the tile's largest |value| to 448; the weight is the value over its scale, in E4M3."""
    rows, cols = w.shape
    R, C = -(-rows // 128), -(-cols // 128)
    scale_inv = np.ones((R, C), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for r in range(R):
        for c in range(C):
            tile = w[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128].astype(np.float32)
            amax = float(np.abs(tile).max())
            scale_inv[r, c] = amax / E4M3_MAX if amax else 1.0
            q[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128] = np.clip(tile / scale_inv[r, c], -448, 448)
    return q, scale_inv


def test_format_quantized_file_dequantizes_as_decoded_by_hand(tmp_path):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((300, 200)) * np.exp(rng.uniform(-6, 2, (300, 1)))).astype(np.float32)
    w[:128, :128] *= 1e-4  # a tile of small values: subnormal codes
    w[128:256, 128:] = 0  # a zero tile (scale 1)
    q, s = quantize(w)  # tiles: 3 x 2, the last row of tiles 44 tall, the last column 72 wide
    path = str(tmp_path / "w.safetensors")
    save_file({"proj.weight": q, "proj.weight_scale_inv": s}, path)
    f = SafetensorsFile(path)
    weight, scale_inv = f.get("proj.weight"), f.get("proj.weight_scale_inv")
    assert weight.dtype == ml_dtypes.float8_e4m3fn and scale_inv.shape == (3, 2)
    got = fp8_blocks.dequantize(weight, scale_inv)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, decode(weight, scale_inv))
    # And the decoding is the tensor's: within E4M3's half step (2**-4 relative, or the
    # subnormal step 2**-10 times the tile's scale).
    i, j = np.arange(300)[:, None] // 128, np.arange(200)[None, :] // 128
    bound = np.maximum(np.abs(w) * 2.0**-4, scale_inv[i, j] * 2.0**-10)
    assert (np.abs(got - w) <= bound).all()


def test_every_code_in_every_tile_position_decodes_by_hand():
    """Random bytes: every code (NaN, -0, subnormals, 448) in every tile, scales of any
    mantissa; stacked experts ``[E, out, in]`` too."""
    rng = np.random.default_rng(1)
    weight = rng.integers(0, 256, (2, 130, 257), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale_inv = np.exp2(rng.uniform(-12, 4, (2, 2, 3))).astype(np.float32)
    got = fp8_blocks.dequantize(weight, scale_inv)
    for e in range(2):
        np.testing.assert_array_equal(got[e], decode(weight[e], scale_inv[e]))


F8 = ml_dtypes.float8_e4m3fn


@pytest.mark.parametrize(
    "weight_dtype, scale_shape, scale_dtype, match",
    [
        (F8, (2, 2), np.float32, r"weight \(300, 200\) and weight_scale_inv \(2, 2\)"),
        (F8, (5, 4), np.float32, r"128x128 blocks need scales \(3, 2\)"),
        (np.float32, (3, 2), np.float32, "expected float8_e4m3fn"),
        (F8, (3, 2), ml_dtypes.bfloat16, "bfloat16"),
        (ml_dtypes.float8_e5m2, (3, 2), np.float32, "float8_e5m2"),
    ],
    ids=["scales-short", "64x64-scales", "weight-f32", "scales-bf16", "e5m2"],
)
def test_malformed_tensors_are_refused(weight_dtype, scale_shape, scale_dtype, match):
    weight, scale_inv = np.zeros((300, 200), weight_dtype), np.ones(scale_shape, scale_dtype)
    with pytest.raises(ValueError, match=match):
        fp8_blocks.dequantize(weight, scale_inv)


@pytest.mark.parametrize(
    "quant, match",
    [
        (QUANT | {"weight_block_size": None}, "per-tensor"),
        (QUANT | {"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
        (QUANT | {"fmt": "e5m2"}, "'e5m2'"),
        (QUANT | {"expert_dtype": "int4"}, "'int4'"),
        (QUANT | {"scale_fmt": "e4m3"}, "scale_fmt 'e4m3'"),
    ],
    ids=["per-tensor", "block-64", "e5m2", "int4-experts", "scale-e4m3"],
)
def test_unsupported_fp8_configs_are_refused(quant, match):
    fp8_blocks.check_config(QUANT | {"scale_fmt": "ue8m0"}, "config.json")  # V3.1, V4
    fp8_blocks.check_config(QUANT | {"scale_fmt": "ue8m0", "expert_dtype": "fp4"}, "config.json")  # V4
    with pytest.raises(CheckpointError, match=match):
        fp8_blocks.check_config(quant, "config.json")


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Llama checkpoint (intermediate 300: MLP weights 3 tiles long, the last partial)
    rewritten as FP8 with block scales beside each Linear's weight, and the same checkpoint
    holding those weights dequantized, in float32 (embeddings, norms and lm_head stay); the
    decoded weights and the FP8 tensors by name."""
    base = make("llama", str(tmp_path_factory.mktemp("llama")), overrides={"intermediate_size": 300})
    tensors = load_file(os.path.join(base, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    fp8, dense, decoded = dict(tensors), dict(tensors), {}
    for name in [n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in LINEARS))]:
        q, s = quantize(tensors[name])
        fp8[name], fp8[name + "_scale_inv"] = q, s
        dense[name] = decoded[name] = decode(q, s)
    out = {}
    for kind, ts, cfg in (("fp8", fp8, config | {"quantization_config": QUANT}), ("dense", dense, config)):
        d = str(tmp_path_factory.mktemp(kind))
        save_file(ts, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        out[kind] = d
    return out["fp8"], out["dense"], decoded, fp8


def test_fp8_checkpoint_loads_dequantized_and_serves_the_same_logprobs(checkpoints):
    fp8, dense, decoded, _ = checkpoints
    model = load_hf(fp8, dtype="float32")
    # Exactly the decoded values, in our [in, out] layout.
    mlp = model.layers[1].mlp
    np.testing.assert_array_equal(mlp.down_proj.kernel[...], decoded["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(mlp.up_proj.kernel[...], decoded["model.layers.1.mlp.up_proj.weight"].T)
    want = nnx.to_pure_dict(nnx.state(load_hf(dense, dtype="float32")))
    got = nnx.to_pure_dict(nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    # In bfloat16, the serving dtype: the float32 values rounded once.
    bf16 = load_hf(fp8, dtype="bfloat16").layers[0].mixer.k_proj.kernel[...]
    k = decoded["model.layers.0.self_attn.k_proj.weight"].T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16), k)

    ids = [int(x) for x in np.random.RandomState(0).randint(0, 512, size=40)]
    logprobs = []
    for path in (fp8, dense):
        llm = LLM(model_path=path, dtype="float32", page_size=16, max_running_requests=4)
        try:
            out = llm.generate(
                input_ids=ids,
                sampling_params={"max_new_tokens": 1, "temperature": 0},
                return_logprob=True,
                logprob_start_len=0,
            )
        finally:
            llm.close()
        lps = out[0]["meta_info"]["input_token_logprobs"]
        assert [x[1] for x in lps] == ids
        logprobs.append([x[0] for x in lps[1:]])
    assert logprobs[0] == logprobs[1]


def test_fp8_checkpoint_with_bad_scales_is_refused(checkpoints, tmp_path):
    fp8, _, _, tensors = checkpoints
    name = "model.layers.0.mlp.down_proj.weight"
    for corrupt, match in [
        (lambda t: t.update({name + "_scale_inv": t[name + "_scale_inv"][:, :1]}), r"\(64, 300\).*\(1, 1\)"),
        (lambda t: t.pop(name + "_scale_inv"), "float8_e4m3fn; only a Linear's weight"),
    ]:
        broken = dict(tensors)
        corrupt(broken)
        os.makedirs(tmp_path / "broken", exist_ok=True)
        save_file(broken, str(tmp_path / "broken" / "model.safetensors"))
        with open(os.path.join(fp8, "config.json")) as f, open(tmp_path / "broken" / "config.json", "w") as g:
            g.write(f.read())
        with pytest.raises(CheckpointError, match=match) as e:
            load_hf(str(tmp_path / "broken"), dtype="float32")
        assert name in str(e.value)


# DeepSeek V4's published format: E8M0 scales (powers of two), routed experts in FP4.


def e8m0(code: int) -> float:
    """One E8M0 byte: an exponent alone, bias 127 (0xff is NaN)."""
    return float("nan") if code == 0xFF else 2.0 ** (code - 127)


def e2m1(code: int) -> float:
    """One E2M1 nibble from its bits: sign, two exponent bits (bias 1), one mantissa bit;
    exponent 0 is subnormal (``m / 2``)."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    return sign * (mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


FP4_VALUES = np.array([e2m1(c) for c in range(16)])


def quantize_ue8m0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize`` with each tile's scale rounded up to a power of two, stored as E8M0."""
    q, s = quantize(w)
    exponent = np.ceil(np.log2(np.maximum(s, 2.0**-126)))
    s2 = np.exp2(exponent).astype(np.float32)
    rows, cols = w.shape
    i, j = np.arange(rows)[:, None] // 128, np.arange(cols)[None, :] // 128
    q = np.clip(w / s2[i, j], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, (exponent + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32 values of a row, the power of two mapping their largest |value| to at most 6;
    each value to the nearest E2M1 code; two codes a byte, the even column low."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    amax = np.maximum(np.abs(groups).max(-1), 2.0**-126)
    exponent = np.ceil(np.log2(amax / 6.0))
    scaled = groups / np.exp2(exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).reshape(rows, cols).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8)
    return packed, (exponent + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def decode_fp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    b = packed.view(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
    scale = np.array([e8m0(c) for c in range(256)])[scales.view(np.uint8)]
    return (FP4_VALUES[codes] * np.repeat(scale, 32, axis=1)).astype(np.float32)


def decode_ue8m0(weight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    s = np.array([e8m0(c) for c in range(256)])[scales.view(np.uint8)]
    return decode(weight, s)


def test_deepseek_v4_fp8_and_fp4_checkpoint_loads_as_decoded(tmp_path):
    """The tiny V4 checkpoint rewritten as published: attention, shared-expert and MTP
    projection Linears in FP8 with E8M0 128x128 scales (``N.scale``), routed experts in FP4
    with an E8M0 scale per 32 values, the published names (``layers.<i>``, ``embed``,
    ``norm``, ``hc_head_fn``, ``attn.kv_norm``; transformers writes ``model.layers.<i>``,
    ``attn.norm`` ...) and a multi-token-prediction block ``mtp.0.*``; it loads to exactly
    what the decoders above give, the block's tensors into ``model.mtp[0]``, and serves the
    prompt logprobs of the same checkpoint holding those values in float32."""
    base = make("deepseek_v4", str(tmp_path / "base"))
    tensors = load_file(os.path.join(base, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f) | {"num_nextn_predict_layers": 1}
    tensors |= mtp_tensors(tensors)
    quantized, dense = dict(tensors), dict(tensors)
    fp8 = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".shared_experts.")
    fp8 += (".e_proj.", ".h_proj.")
    for name, w in tensors.items():
        if not name.endswith(".weight"):
            continue
        if ".ffn.experts." in name:
            q, s = quantize_fp4(w)
            dense[name] = decode_fp4(q, s)
        elif any(p in name for p in fp8):
            q, s = quantize_ue8m0(w)
            dense[name] = decode_ue8m0(q, s)
        else:
            continue
        quantized[name], quantized[name.removesuffix("weight") + "scale"] = q, s
    published = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    published |= {f"model.hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}
    quantized = {
        published.get(n, n.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")): t
        for n, t in quantized.items()
    }
    assert "layers.1.attn.wkv.scale" in quantized and "layers.1.attn.kv_norm.weight" in quantized
    assert (
        quantized["mtp.0.e_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
        and "mtp.0.e_proj.scale" in quantized
    )
    assert quantized["mtp.0.ffn.experts.0.w1.weight"].dtype == np.int8
    quant = QUANT | {"scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    paths = {}
    variants = (("q", quantized, config | {"quantization_config": quant}), ("dense", dense, config))
    for kind, ts, cfg in variants:
        d = str(tmp_path / kind)
        os.makedirs(d)
        save_file(ts, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        paths[kind] = d
    got = nnx.to_pure_dict(nnx.state(load_hf(paths["q"], dtype="float32")))
    want = nnx.to_pure_dict(nnx.state(load_hf(paths["dense"], dtype="float32")))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    experts = got["layers"][1]["mlp"]["down"]  # [E, I, H]: expert 0's w2 [H, I], transposed
    np.testing.assert_array_equal(experts[0], dense["model.layers.1.ffn.experts.0.w2.weight"].T)
    assert len(np.unique(dense["model.layers.1.ffn.experts.0.w2.weight"])) <= 16 * 64  # FP4 codes x scales
    # The MTP block: each of its tensors in the file, dequantized, is one of its parameters.
    mtp = got["mtp"][0]
    np.testing.assert_array_equal(mtp["e_proj"]["kernel"], dense["mtp.0.e_proj.weight"].T)
    np.testing.assert_array_equal(mtp["h_proj"]["kernel"], dense["mtp.0.h_proj.weight"].T)
    np.testing.assert_array_equal(
        mtp["layer"]["mixer"]["kv_proj"]["kernel"], dense["mtp.0.attn.wkv.weight"].T
    )
    np.testing.assert_array_equal(
        mtp["layer"]["mixer"]["kv_norm"]["weight"], dense["mtp.0.attn.kv_norm.weight"]
    )
    np.testing.assert_array_equal(mtp["layer"]["mlp"]["down"][1], dense["mtp.0.ffn.experts.1.w2.weight"].T)
    np.testing.assert_array_equal(mtp["head"]["hc_fn"], dense["mtp.0.hc_head_fn"])
    held = sum(np.size(x) for x in jax.tree_util.tree_leaves(mtp))
    assert held == sum(t.size for n, t in dense.items() if n.startswith("mtp.0."))

    ids = [int(x) for x in np.random.RandomState(0).randint(0, 512, size=40)]
    logprobs = []
    for path in (paths["q"], paths["dense"]):
        llm = LLM(model_path=path, dtype="float32", page_size=16, max_running_requests=4)
        try:
            out = llm.generate(
                input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
            )
        finally:
            llm.close()
        logprobs.append([x[0] for x in out[0]["meta_info"]["input_token_logprobs"][1:]])
    assert logprobs[0] == logprobs[1]
