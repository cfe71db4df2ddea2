"""The page-auth key: its file and flag checks, and a client that writes MACs and refuses
pages that fail them (a miss, counted as corrupt_auth, deleted and rewritten)."""

import os
import time

import ml_dtypes
import numpy as np
import pytest

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.storage.auth import MIN_KEY_BYTES, BadAuthKey, key_id, read_auth_key
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.faults import forge
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import page_path
from hicache_jax.storage.tensorstore_store import TensorStoreL3

K1, K2 = b"first-key-" * 4, b"second-key" * 4
BASE = Namespace("tiny", "bfloat16", 4, 1)
NS1 = Namespace("tiny", "bfloat16", 4, 1, auth_id=key_id(K1))
NS2 = Namespace("tiny", "bfloat16", 4, 1, auth_id=key_id(K2))
L3 = dict(enable_hierarchical_cache=True, hicache_storage_backend="tensorstore")


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _pages(ns, n=4):
    return [
        (page_path(ns, h, "kv"), {"k": np.full((2, 4, 8), i + 1, ml_dtypes.bfloat16)})
        for i, h in enumerate(page_hashes(np.arange(4 * n), 4, ns))
    ]


def test_key_file_is_stripped_and_checked(tmp_path):
    assert read_auth_key(_write(tmp_path / "a", b"  " + K1 + b"\n")) == K1  # echo's newline is no part of it
    with pytest.raises(BadAuthKey, match=f"at least {MIN_KEY_BYTES} bytes"):
        read_auth_key(_write(tmp_path / "b", b"short\n"))
    with pytest.raises(BadAuthKey, match="at most"):
        read_auth_key(_write(tmp_path / "c", b"x" * 5000))
    with pytest.raises(BadAuthKey, match="cannot read"):
        read_auth_key(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "must be a readable file"),
        (b"\n\t \n", "must hold a key of 16 to 4096 bytes"),
        (b"x" * 15, "must hold a key of 16 to"),
    ],
)
def test_the_flag_names_itself_and_never_the_key(tmp_path, content, says):
    path = str(tmp_path / "key") if content is None else _write(tmp_path / "key", content)
    with pytest.raises(ConfigError, match=f"hicache_storage_auth_key_file='{path}': {says}") as info:
        EngineConfig(**L3, hicache_storage_auth_key_file=path)
    assert "x" * 15 not in str(info.value)


def test_the_flag_needs_an_l3_backend_and_holds_only_the_path(tmp_path):
    path = _write(tmp_path / "key", K1)
    with pytest.raises(ConfigError, match="hicache_storage_auth_key_file is set but hicache_storage_backend"):
        EngineConfig(hicache_storage_auth_key_file=path)
    cfg = EngineConfig(**L3, hicache_storage_auth_key_file=path)
    assert K1.decode() not in repr(cfg)  # what /server_info echoes: the path, not the key


def test_dev_zero_is_refused_without_reading_it_whole():
    t0 = time.monotonic()
    with pytest.raises(BadAuthKey, match="at most"):
        read_auth_key("/dev/zero")
    assert time.monotonic() - t0 < 1


def test_namespace_and_key_must_agree():
    store = TensorStoreL3("memory://")
    for ns, key in ((BASE, K1), (NS1, None), (NS1, K2)):
        with pytest.raises(ValueError, match="auth_id"):
            StorageClient(store, ns, auth_key=key)


@pytest.fixture
def spec(tmp_path):
    return str(tmp_path / "l3")


def test_same_key_reads_what_it_wrote(spec):
    items = _pages(NS1)
    with StorageClient(TensorStoreL3(spec), NS1, auth_key=K1) as w:
        assert w.write_async(items).result(timeout=10) == 4
    with StorageClient(TensorStoreL3(spec), NS1, auth_key=K1) as r:
        pages = r.prefetch([k for k, _ in items]).result(timeout=10)
        assert [int(p["k"][0, 0, 0]) for p in pages] == [1, 2, 3, 4]
        assert r.stats()["corrupt_auth"] == 0


@pytest.mark.parametrize("write_key", [None, K2], ids=["no_key", "wrong_key"])
def test_forged_page_is_a_counted_miss_then_deleted_and_rewritten(spec, write_key):
    items = _pages(NS1)
    keys = [k for k, _ in items]
    with StorageClient(TensorStoreL3(spec), NS1, auth_key=K1) as c:
        c.write_async(items)
        assert c.flush(10)
        bad = keys[2]
        (value,) = c.store.get([bad])
        c.store.put([(bad, forge(value, NS1.fingerprint, bad, read_key=K1, write_key=write_key))], force=True)
        assert len(c.prefetch(keys).result(timeout=10)) == 2  # the hit stops before the forged page
        stats = c.stats()
        assert stats["corrupt_auth"] == 1 and stats["checksum_failures"] == 1
        deadline = time.monotonic() + 5
        while c.store.exists([bad]) != [False]:  # deleted after the prefetch answered
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.write_async(items).result(timeout=10) == 1  # the next backup rewrites it
        assert len(c.prefetch(keys).result(timeout=10)) == 4


def test_a_page_of_another_key_copied_into_our_path_fails_the_mac(spec):
    """Different keys never share a path (auth_id); a page moved from one to the other is
    refused by the MAC, not only by the namespace check."""
    mine, theirs = _pages(NS1), _pages(NS2)
    assert not {k for k, _ in mine} & {k for k, _ in theirs}
    with StorageClient(TensorStoreL3(spec), NS2, auth_key=K2) as other:
        other.write_async(theirs)
        assert other.flush(10)
    with StorageClient(TensorStoreL3(spec), NS1, auth_key=K1) as c:
        (value,) = c.store.get([theirs[0][0]])
        c.store.put([(mine[0][0], value)])
        assert c.prefetch([mine[0][0]]).result(timeout=10) == []
        assert c.stats()["corrupt_auth"] == 1
        assert c.prefetch([theirs[0][0]]).result(timeout=10) == []  # their path: their MAC
    with StorageClient(TensorStoreL3(spec), BASE) as keyless:  # no key: another path again
        assert keyless.match_prefix([page_path(BASE, *_hk(theirs[0][0]))]) == 0


def _hk(path):
    leaf = os.path.basename(path)
    return bytes.fromhex(leaf.split(".")[0]), leaf.split(".")[1]
