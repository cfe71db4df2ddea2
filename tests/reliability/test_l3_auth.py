"""Finding 5 of issue 39 and its fix, through engines on one store: with a page-auth key, a
page crafted by someone who can write the store but lacks the key is a counted miss and the
output equals a recompute; servers with another key, or none, never read the keyed pages.
Without a key the store is trusted, and the crafted page IS served (asserted, so that this
test tells the truth about that mode)."""

from __future__ import annotations

import numpy as np

from hicache_jax.server.metrics import render
from hicache_jax.storage.faults import forge
from tests.cache.l3_helpers import P, assert_same_as_recompute, logprobs, prompt, run
from tests.reliability.conftest import kv_keys

BAD = 6  # the crafted page: pages before it may still hit
K1, K2 = b"k1-0123456789abcdef-0123456789\n", b"k2-0123456789abcdef-0123456789\n"


def _storage_hit(out) -> int:
    return out["meta_info"]["cached_tokens_details"]["storage"]


def _key_file(tmp_path, name, key) -> str:
    path = tmp_path / name
    path.write_bytes(key)
    path.chmod(0o600)
    return str(path)


def _craft(llm, key, read_key, write_key) -> None:
    """Replace the page at `key` by the same page with zeroed KV, encoded by `write_key`."""
    store, ns = llm.engine.storage.client.store, llm.engine.storage.namespace
    (value,) = store.get([key])
    store.put([(key, forge(value, ns.fingerprint, key, read_key=read_key, write_key=write_key))], force=True)


def test_keys_isolate_servers_and_a_crafted_page_is_a_counted_miss(make_llm, tmp_path):
    spec = tmp_path / "l3"
    k1, k2 = _key_file(tmp_path, "k1", K1), _key_file(tmp_path, "k2", K2)
    a = make_llm(spec, hicache_storage_auth_key_file=k1)
    ids = prompt(seed=51)
    ref = run(a, ids)  # nothing cached: a recompute
    assert _storage_hit(ref) == 0 and a.flush_cache().success  # A's pages are in L3 now

    b = make_llm(spec, hicache_storage_auth_key_file=k1)
    hit = run(b, ids)
    assert _storage_hit(hit) >= len(ids) - P
    assert_same_as_recompute(hit, ref)
    assert b.engine.storage.namespace == a.engine.storage.namespace

    for other in (make_llm(spec, hicache_storage_auth_key_file=k2), make_llm(spec)):
        out = run(other, ids)
        assert _storage_hit(out) == 0  # another key's (or no key's) pages are never read ...
        assert other.engine.metrics()["l3_corrupt_auth"] == 0  # ... not even tried
        assert_same_as_recompute(out, ref)

    # Someone who can write the store but lacks K1 crafts A's page BAD: no MAC, then a MAC
    # under their own key. Each is a miss past page BAD, counted, and the output is right.
    page = kv_keys(a, ids)[BAD]
    for write_key in (None, K2.strip()):
        assert b.flush_cache().success
        _craft(b, page, read_key=K1.strip(), write_key=write_key)
        before = b.engine.metrics()["l3_corrupt_auth"]
        out = run(b, ids)
        assert b.engine.metrics()["l3_corrupt_auth"] == before + 1
        assert _storage_hit(out) <= BAD * P
        assert_same_as_recompute(out, ref)
    assert b"hicache_l3_corrupt_auth_total 2.0" in render(b.engine.metrics())

    # The crafted page was deleted and B's backup rewrote it: the next run hits again.
    assert b.flush_cache().success
    again = run(b, ids)
    assert _storage_hit(again) >= len(ids) - P
    assert_same_as_recompute(again, ref)


def test_without_a_key_the_store_is_trusted_and_a_crafted_page_is_served(make_llm, tmp_path):
    """Finding 5 as it stands without --hicache_storage_auth_key_file: documented, not fixed.
    A page re-encoded with zeroed KV, the right key, namespace and a valid CRC is a hit, and
    the output differs from a recompute."""
    llm = make_llm(tmp_path / "l3")
    ids = prompt(seed=52)
    ref = run(llm, ids)
    assert llm.flush_cache().success
    _craft(llm, kv_keys(llm, ids)[BAD], read_key=None, write_key=None)
    out = run(llm, ids)
    stats = llm.engine.metrics()
    assert _storage_hit(out) >= len(ids) - P  # the crafted page was served ...
    assert stats["l3_checksum_failures"] == stats["l3_corrupt_auth"] == 0  # ... unnoticed
    r = logprobs(out) - logprobs(ref)
    assert (np.exp(r) - 1 - r).max() > 1e-6, "zeroed KV should have changed the output"
