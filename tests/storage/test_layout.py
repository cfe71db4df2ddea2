"""The L3 layout: pages fan out under their namespace; old flat stores are refused."""

import collections
import dataclasses
import os

import numpy as np
import pytest

from hicache_jax.storage import gc
from hicache_jax.storage.auth import key_id
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.faults import FaultyStore
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import (
    MARKER,
    LegacyLayout,
    namespace_dir,
    page_path,
    parse_page_path,
)
from hicache_jax.storage.tensorstore_store import TensorStoreL3

NS = Namespace("tiny", "bfloat16", 4, 1)


def test_page_path_fans_out_under_the_namespace():
    (h,) = page_hashes(np.arange(4), 4, NS)
    path = page_path(NS, h, "kv")
    fields = "kv_dtype=bfloat16,page_size=4,layout_version=1,tp_rank=0,tp_size=1"
    assert path == f"pages/tiny/{fields}/nosalt/{h[:1].hex()}/{h[1:2].hex()}/{h.hex()}.kv"
    parsed = parse_page_path(path)
    assert (parsed.ns_dir, parsed.hash, parsed.kind, parsed.path) == (namespace_dir(NS), h, "kv", path)
    for bad in ("pages/x.kv", f"{h.hex()}.kv", path.replace("/nosalt/", "/nosalt/zz/"), path[:-2] + "xx"):
        assert parse_page_path(bad) is None, bad


def test_namespace_dir_names_every_field_and_hides_the_salt():
    salted = NS.with_salt("tenant secret/../x")
    d = namespace_dir(salted)
    assert "secret" not in d and d.count("/") == 2 and d.split("/")[2].startswith("salt-")
    assert namespace_dir(NS) != d != namespace_dir(NS.with_salt(""))

    # A field added to Namespace (e.g. a TP layout) reaches the path with no layout change.
    @dataclasses.dataclass(frozen=True)
    class Wider(Namespace):
        tp_layout: str = "heads"

    wide = Wider("tiny", "bfloat16", 4, 1)
    assert "tp_layout=heads" in namespace_dir(wide) and namespace_dir(wide) != namespace_dir(NS)
    assert namespace_dir(Namespace("weird model/..", "f32", 4, 1)).startswith("h-")


def test_an_auth_key_shows_in_the_path_and_no_key_keeps_the_old_one():
    keyed = dataclasses.replace(NS, auth_id=key_id(b"k" * 32))
    fields = "kv_dtype=bfloat16,page_size=4,layout_version=1,tp_rank=0,tp_size=1"
    assert namespace_dir(NS) == f"tiny/{fields}/nosalt"  # what stores from before keys hold
    assert namespace_dir(keyed) == f"tiny/{fields},auth_id={keyed.auth_id}/nosalt"
    # The server's usual config (bfloat16, 16-token pages) keeps a readable path with a key.
    usual = Namespace("m", "bfloat16", 16, 1, auth_id=keyed.auth_id)
    assert "auth_id=" in namespace_dir(usual)
    (h,) = page_hashes(np.arange(4), 4, keyed)
    assert parse_page_path(page_path(keyed, h, "kv")).ns_dir == namespace_dir(keyed)


def test_no_directory_holds_more_than_a_few_thousand_entries(tmp_path):
    """256 x 256 leaf dirs: 10M pages give ~153 per leaf. Checked on a real store of 1,000
    pages, and on 200,000 hashes for the bound."""
    store = TensorStoreL3(str(tmp_path))
    hashes = page_hashes(np.arange(4 * 1000), 4, NS)
    store.put([(page_path(NS, h, "kv"), b"x") for h in hashes])
    widest = max(len(files) + len(dirs) for _, dirs, files in os.walk(tmp_path))
    assert widest <= 256, widest  # no directory wider than one fan-out level
    rng = np.random.default_rng(0)
    leaves = collections.Counter(bytes(rng.integers(0, 256, 2, dtype=np.uint8)) for _ in range(200_000))
    scale = 10_000_000 / 200_000  # the fullest leaf at 10M pages, from this sample
    assert max(leaves.values()) * scale < 2_000


def test_exists_costs_the_batch_not_the_store(tmp_path):
    """Existence probes are per-key reads: no listing, whatever the store holds."""
    store = FaultyStore(TensorStoreL3(str(tmp_path)))
    calls = []
    store.inner.list_keys = lambda *a: calls.append(a) or []
    with StorageClient(store, NS, check_layout=False) as client:
        keys = [page_path(NS, h, "kv") for h in page_hashes(np.arange(40), 4, NS)]
        store.put([(k, b"v") for k in keys[:5]])
        assert client.match_prefix(keys) == 5
    assert not calls and store.calls["exists"] == 1


def test_old_flat_store_is_refused_then_dropped_by_gc(tmp_path):
    flat = TensorStoreL3(str(tmp_path))
    h = page_hashes(np.arange(8), 4, NS)
    flat.put([(f"{x.hex()}.kv", b"old") for x in h])
    with pytest.raises(LegacyLayout, match="drop_legacy"):
        StorageClient(TensorStoreL3(str(tmp_path)), NS)
    collector = gc.Collector(TensorStoreL3(str(tmp_path)), quiet=True)
    assert collector.drop_legacy(dry_run=True) == {"pages": 2, "dry_run": True}
    assert collector.drop_legacy(dry_run=False)["pages"] == 2
    collector.close()
    StorageClient(TensorStoreL3(str(tmp_path)), NS).close()  # accepted, and now marked
    assert MARKER in flat.list_keys()
