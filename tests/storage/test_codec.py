"""Page codec: round trips per dtype and detection of every kind of damage; with a key, a MAC
that refuses forged, swapped and unsigned pages."""

import struct
import zlib

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


def _reason(blob, fp=FP, key=None, auth=None):
    with pytest.raises(CorruptPage) as info:
        decode_page(blob, fp, key, auth_key=auth)
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


# -- authenticated pages (format 2) ---------------------------------------------------------
K1, K2 = b"k1" * 16, b"k2" * 16
KEY = "pages/m/f/nosalt/ab/cd/abc.kv"


@pytest.fixture
def signed():
    return encode_page(_page(ml_dtypes.bfloat16), FP, KEY, auth_key=K1)


def _recrc(blob: bytes) -> bytes:
    """`blob` with a valid crc again, as anyone (no key needed) can make it."""
    crc = zlib.crc32(blob[32:], zlib.crc32(blob[:28]))
    return blob[:28] + struct.pack("<I", crc) + blob[32:]


def test_signed_round_trip_is_version_2_with_aligned_views(signed):
    assert struct.unpack_from("<H", signed, 4)[0] == 2
    out = decode_page(signed, FP, KEY, auth_key=K1)
    for name, arr in _page(ml_dtypes.bfloat16).items():
        np.testing.assert_array_equal(out[name].view(np.uint8), arr.view(np.uint8))
        assert (out[name].ctypes.data - np.frombuffer(signed, np.uint8).ctypes.data) % ALIGN == 0
    # A keyless reader (trusted store) still decodes it; a key is a property of the reader.
    decode_page(signed, FP, KEY)


def test_wrong_key_or_moved_page_fails_the_mac(signed):
    assert _reason(signed, key=KEY, auth=K2) == "auth"
    assert _reason(signed, key="pages/m/f/nosalt/ab/cd/def.kv", auth=K1) == "auth"  # swapped
    assert _reason(signed, fp=OTHER_FP, key=KEY, auth=K1) == "auth"  # another namespace


def test_unsigned_pages_are_refused_with_a_key():
    plain = encode_page(_page(ml_dtypes.bfloat16), FP, KEY)  # version 1: no MAC
    assert _reason(plain, key=KEY, auth=K1) == "auth"
    with pytest.raises(CorruptPage, match="carries no MAC"):  # said so, not only a MAC mismatch
        decode_page(plain, FP, KEY, auth_key=K1)
    decode_page(plain, FP, KEY)  # without a key it is what every existing store holds


@pytest.mark.parametrize("where", [6, 12, 40, 70, 200, -1])
def test_a_tampered_byte_anywhere_fails_the_mac(signed, where):
    """A byte changed in the header, the MAC, the metadata or the payload, crc fixed up."""
    blob = bytearray(signed)
    blob[where] ^= 0x01
    assert _reason(bytes(blob), key=KEY, auth=K1) == "checksum"  # crc not fixed: plain damage
    assert _reason(_recrc(bytes(blob)), key=KEY, auth=K1) == "auth"


def test_a_swapped_mac_fails(signed):
    other = encode_page({"k": np.zeros((2, 16, 3), ml_dtypes.bfloat16)}, FP, KEY, auth_key=K1)
    blob = _recrc(signed[:32] + other[32:64] + signed[64:])
    assert _reason(blob, key=KEY, auth=K1) == "auth"


def test_forged_page_under_the_right_key_path_fails():
    """Someone without the key re-encodes a page with zeroed arrays: with no MAC, or a MAC
    under their own key. The crc is valid either way; only the MAC refuses it."""
    zero = {n: np.zeros_like(a) for n, a in _page(ml_dtypes.bfloat16).items()}
    for forged in (encode_page(zero, FP, KEY), encode_page(zero, FP, KEY, auth_key=K2)):
        assert _reason(forged, key=KEY, auth=K1) == "auth"
        decode_page(forged, FP, KEY)  # a keyless reader takes it: the trusted-store case


def test_a_key_needs_the_expected_page_key(signed):
    with pytest.raises(ValueError, match="expected_key"):
        decode_page(signed, FP, auth_key=K1)
