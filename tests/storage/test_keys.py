"""Page keys: chained SHA-256 per full page, seeded by the namespace."""

import hashlib
import struct

import numpy as np
import pytest

from hicache_jax.storage.auth import key_id
from hicache_jax.storage.keys import Namespace, page_hashes, page_key, page_keys, parse_key

NS = Namespace("model-a", "bfloat16", 4, 1)


def _reference_chain(tokens, page_size, seed):
    """Independent re-statement of the design: h_i = sha256(h_{i-1} || u32le(page_i))."""
    out, prev = [], seed
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *page)).digest()
        out.append(prev)
    return out


def test_known_answer_chain():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 2**32 - 1, 0, 17, 99]
    assert page_hashes(tokens, 4, NS) == _reference_chain(tokens, 4, NS.digest)
    # The namespace digest is SHA-256 of the canonical field encoding.
    assert NS.digest == hashlib.sha256(NS.canonical_bytes()).digest()
    assert NS.fingerprint == NS.digest[:8].hex()


def test_partial_pages_have_no_hash():
    assert page_hashes([1, 2, 3], 4, NS) == []
    assert page_hashes([], 4, NS) == []
    assert len(page_hashes(list(range(11)), 4, NS)) == 2
    assert page_hashes(list(range(11)), 4, NS) == page_hashes(list(range(8)), 4, NS)


def test_incremental_start_hash_equals_full():
    tokens = np.arange(40, dtype=np.int64)
    full = page_hashes(tokens, 4, NS)
    for k in range(1, 10):
        rest = page_hashes(tokens[4 * k :], 4, NS, start_hash=full[k - 1])
        assert full[:k] + rest == full


def test_numpy_and_list_inputs_agree():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert page_hashes(np.array(tokens, dtype), 4, NS) == page_hashes(tokens, 4, NS)


@pytest.mark.parametrize(
    "other",
    [
        Namespace("model-b", "bfloat16", 4, 1),
        Namespace("model-a", "float32", 4, 1),
        Namespace("model-a", "bfloat16", 4, 2),
        Namespace("model-a", "bfloat16", 4, 1, tp_rank=1, tp_size=2),
        Namespace("model-a", "bfloat16", 4, 1, cache_salt="tenant-1"),
        Namespace("model-a", "bfloat16", 4, 1, cache_salt=""),
        Namespace("model-a", "bfloat16", 4, 1, auth_id="0123456789abcdef"),
    ],
)
def test_every_namespace_field_changes_keys(other):
    tokens = list(range(8))
    assert other.digest != NS.digest
    assert not set(page_hashes(tokens, 4, other)) & set(page_hashes(tokens, 4, NS))


def test_page_size_changes_keys():
    ns8 = Namespace("model-a", "bfloat16", 8, 1)
    tokens = list(range(16))
    assert not set(page_hashes(tokens, 8, ns8)) & set(page_hashes(tokens, 4, NS))
    with pytest.raises(ValueError, match="page_size"):
        page_hashes(tokens, 8, NS)


def test_salts_isolate_tenants():
    a, b = NS.with_salt("a"), NS.with_salt("b")
    assert page_hashes([1, 2, 3, 4], 4, a) != page_hashes([1, 2, 3, 4], 4, b)
    assert a.with_salt(None) == NS


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [2**70, 0, 0, 0], [1.5, 2, 3, 4]])
def test_out_of_range_token_ids_rejected(bad):
    with pytest.raises(ValueError, match="token ids"):
        page_hashes(bad, 4, NS)


def test_key_strings():
    h = page_hashes([1, 2, 3, 4], 4, NS)[0]
    assert page_key(h, "kv") == h.hex() + ".kv"
    assert parse_key(page_key(h, "state")) == (h, "state")
    assert page_keys([h, h], "swa") == [h.hex() + ".swa"] * 2
    with pytest.raises(ValueError, match="kind"):
        page_key(h, "bogus")
    with pytest.raises(ValueError, match="32 bytes"):
        page_key(h[:5], "kv")
    with pytest.raises(ValueError, match="malformed"):
        parse_key("abc.kv")


def test_namespace_validation():
    with pytest.raises(ValueError):
        Namespace("", "bfloat16", 4, 1)
    with pytest.raises(ValueError):
        Namespace("m", "bfloat16", 0, 1)
    with pytest.raises(ValueError):
        Namespace("m", "bfloat16", 4, 1, tp_rank=2, tp_size=2)


def test_keyless_namespaces_keep_the_digest_of_stores_from_before_keys():
    """auth_id=None leaves the encoding as it was: existing stores' page keys still hit."""
    assert NS.digest.hex() == "53ea1eceb797f25e5d6e85b7daf9c0b63002770d5214bb866313c9632558af4c"
    assert (
        NS.with_salt("t").digest.hex() == "3615e603fbfea5cc6fb9615552fd88c696f3c39016c5eef059ebe2b10752b87d"
    )


def test_auth_ids_isolate_keys_and_survive_a_salt():
    k1 = Namespace("model-a", "bfloat16", 4, 1, auth_id=key_id(b"k1" * 16))
    k2 = Namespace("model-a", "bfloat16", 4, 1, auth_id=key_id(b"k2" * 16))
    assert len({NS.digest, k1.digest, k2.digest}) == 3
    assert k1.with_salt("t").auth_id == k1.auth_id and k1.with_salt("t").digest != k1.digest
    assert key_id(b"k1" * 16) == k1.auth_id and (b"k1" * 16).hex() not in k1.auth_id  # one-way
    for bad in ("", "XYZ", "0123456789ABCDEF", "0123456789abcdef0"):
        with pytest.raises(ValueError, match="auth_id"):
            Namespace("m", "bfloat16", 4, 1, auth_id=bad)


def test_kv_scale_schemes_isolate_keys_and_unquantized_keeps_the_old_digest():
    """Quantized pages' scale scheme (``kv_quant.scheme``) is part of the identity; None
    (unquantized pages) is the namespace of a store from before the field."""
    from hicache_jax.storage.layout import _SAFE, namespace_dir

    fp8 = Namespace("model-a", "float8_e4m3fn", 4, 1, kv_scales="tensor-1")
    a = Namespace("model-a", "int8", 4, 1, kv_scales="tensor-0123456789ab")
    b = Namespace("model-a", "int8", 4, 1, kv_scales="tensor-ba9876543210")
    assert Namespace("model-a", "bfloat16", 4, 1, kv_scales=None).digest == NS.digest
    assert len({NS.digest, fp8.digest, Namespace("model-a", "float8_e4m3fn", 4, 1).digest}) == 3
    assert a.digest != b.digest
    assert not set(page_hashes(list(range(8)), 4, a)) & set(page_hashes(list(range(8)), 4, b))
    fields = namespace_dir(a).split("/")[1]
    assert "kv_scales=tensor-0123456789ab" in fields and _SAFE.match(fields)
    for bad in ("", "a/b", "tensor 1", "x" * 41, 1):
        with pytest.raises(ValueError, match="kv_scales"):
            Namespace("m", "int8", 4, 1, kv_scales=bad)
