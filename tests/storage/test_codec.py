"""Page codec: round trips per dtype and detection of every kind of damage."""

import ml_dtypes
import numpy as np
import pytest

from hicache_jax.storage.codec import ALIGN, CorruptPage, decode_page, encode_page

FP = "0123456789abcdef"
OTHER_FP = "fedcba9876543210"


def _page(dtype, shape=(2, 16, 3)):
    rng = np.random.default_rng(0)
    return {
        "k": rng.standard_normal(shape).astype(dtype),
        "v": (rng.standard_normal(shape) * 3).astype(dtype),
    }


@pytest.mark.parametrize(
    "dtype",
    [
        np.float32,
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        np.int8,
        np.int32,
        np.uint8,
        np.int64,
        np.bool_,
    ],
)
def test_round_trip(dtype):
    page = _page(dtype)
    out = decode_page(encode_page(page, FP, "abc.kv"), FP, "abc.kv")
    assert list(out) == ["k", "v"]
    for name, arr in page.items():
        assert out[name].dtype == arr.dtype and out[name].shape == arr.shape
        np.testing.assert_array_equal(out[name].view(np.uint8), arr.view(np.uint8))


def test_mixed_arrays_order_alignment_and_views():
    page = {
        "conv": np.arange(7, dtype=np.float32).reshape(7, 1),
        "ssm": np.ones((3, 5), ml_dtypes.bfloat16),
        "scalar": np.int32(9),
        "empty": np.zeros((0, 4), np.float16),
        "strided": np.arange(24, dtype=">f4").reshape(4, 6)[:, ::2],
    }
    data = encode_page(page, FP)
    out = decode_page(data, FP)
    assert list(out) == list(page)
    assert out["scalar"].shape == () and out["scalar"] == 9
    np.testing.assert_array_equal(out["strided"], page["strided"])
    for arr in out.values():
        if arr.size:
            assert not arr.flags.writeable  # a view of the stored bytes, not a copy
            assert (arr.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data) % ALIGN == 0


def test_unsupported_dtype_rejected():
    with pytest.raises(ValueError, match="dtype"):
        encode_page({"c": np.zeros(2, np.complex64)}, FP)


@pytest.fixture
def data():
    return encode_page(_page(ml_dtypes.bfloat16), FP, "abc.kv")


def _reason(blob, fp=FP, key=None):
    with pytest.raises(CorruptPage) as info:
        decode_page(blob, fp, key)
    return info.value.reason


def test_flipped_payload_byte(data):
    blob = bytearray(data)
    blob[-5] ^= 0x01
    assert _reason(bytes(blob)) == "checksum"


def test_flipped_metadata_byte(data):
    blob = bytearray(data)
    blob[40] ^= 0x80
    assert _reason(bytes(blob)) == "checksum"


@pytest.mark.parametrize("cut", [0, 10, 31, 32, 100, -1])
def test_truncated(data, cut):
    assert _reason(data[:cut]) == "truncated"


def test_trailing_garbage(data):
    assert _reason(data + b"\0") == "format"


def test_wrong_namespace(data):
    assert _reason(data, fp=OTHER_FP) == "namespace"


def test_wrong_key(data):
    assert _reason(data, key="def.kv") == "key"
    decode_page(data, FP, "abc.kv")


def test_bad_magic(data):
    assert _reason(b"XXXX" + data[4:]) == "bad_magic"


def test_unknown_version(data):
    assert _reason(data[:4] + b"\x63\x00" + data[6:]) == "version"
