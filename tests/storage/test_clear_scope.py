"""Clearing and gc delete only this project's keys: a namespace clear drops its own model's
pages (every tenant) and leaves other models' readable; an all-namespaces clear drops every
page and the evictor's records; another program's files beside them survive either."""

import os
import time

import numpy as np
import pytest

from hicache_jax.storage import gc
from hicache_jax.storage.capacity import INDEX, USAGE, CapacityConfig
from hicache_jax.storage.clearing import clear, own_scope, owned_keys
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.journal import JOURNAL
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import MARKER, PAGES, namespace_dir, page_path
from hicache_jax.storage.lease import LEASE
from hicache_jax.storage.tensorstore_store import TensorStoreL3

A = Namespace("model-a", "float32", 4, 1)
A_SALTED = A.with_salt("tenant")
B = Namespace("model-b", "float32", 4, 1)
TRACKED = CapacityConfig(max_bytes=10**9, tick_s=60, lease_ttl_s=600)


def _pages(ns: Namespace, seed: int, n: int = 3):
    tokens = np.random.default_rng(seed).integers(0, 1000, 4 * n)
    return [
        (page_path(ns, h, "kv"), {"x": np.full(64, j, np.float32)})
        for j, h in enumerate(page_hashes(tokens, 4, ns))
    ]


def _foreign(ns: Namespace) -> list[str]:
    """Files another program put under the store's path: beside the pages, inside a
    namespace's directory, under meta/, and some named like pages but in the wrong place."""
    d = namespace_dir(ns)
    model, fields, _ = d.split("/")
    h = "ab" * 32
    return [
        "notes.txt",
        "userdata/notes.txt",
        f"{h}.kv",  # a layout-1 flat page: only gc --drop_legacy drops those
        "pages/README",
        f"pages/{h}.kv",
        f"pages/{model}/notes.txt",
        f"pages/{d}/notes.txt",
        f"pages/{d}/ab/ab/notes.kv",
        f"pages/{d}/ab/cd/{h}.kv",  # fan-out dirs that do not match the hash
        f"pages/{d}/ab/ab/{h}.bak",  # not a page kind
        f"pages/{model}/{fields}/mysalt/ab/ab/{h}.kv",  # not a salt dir this layout writes
        f"pages/{d}/extra/ab/ab/{h}.kv",  # one level too deep
        "meta/notes.txt",
        "meta/index.bak",
        "meta/journal/notes.txt",
        "meta/journal/12-x-1",
    ]


@pytest.fixture
def filled(tmp_path):
    """Model A (no salt and a tenant) and model B, tracked (journal, index, usage), and
    foreign files; returns (spec, {ns: page keys}, foreign files)."""
    spec = str(tmp_path / "l3")
    written = {}
    for ns, seed in ((A, 1), (A_SALTED, 2), (B, 3)):
        with StorageClient(TensorStoreL3(spec), ns.with_salt(None), capacity=TRACKED) as c:
            items = _pages(ns, seed)
            c.write_async(items, ns)
            assert c.flush(10)
            c.capacity.tick()
        written[ns] = [k for k, _ in items]
    foreign = _foreign(A)
    for name in foreign:
        path = os.path.join(spec, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("mine")
    store = TensorStoreL3(spec)
    assert store.exists([MARKER, INDEX, USAGE]) == [True] * 3 and store.list_keys(JOURNAL)
    return spec, written, foreign


def _intact(spec, foreign):
    for name in foreign:
        with open(os.path.join(spec, name)) as f:
            assert f.read() == "mine", name


def _readable(spec, ns, keys) -> int:
    with StorageClient(TensorStoreL3(spec), ns.with_salt(None)) as c:
        return len(c.prefetch(keys, ns).result(timeout=10))


def test_namespace_clear_drops_every_tenant_of_its_model_only(filled):
    spec, written, foreign = filled
    with StorageClient(TensorStoreL3(spec), A, capacity=TRACKED) as c:
        assert c.clear() == 6  # A's pages, both tenants
    store = TensorStoreL3(spec)
    assert store.exists(written[A] + written[A_SALTED]) == [False] * 6
    assert _readable(spec, B, written[B]) == 3  # another model's pages are untouched
    assert store.exists([MARKER, INDEX, USAGE]) == [True] * 3  # shared records stay
    _intact(spec, foreign)


def test_all_namespaces_clear_drops_every_page_and_the_records_but_no_foreign_file(filled):
    spec, written, foreign = filled
    with StorageClient(TensorStoreL3(spec), A, capacity=TRACKED) as c:
        c.capacity.tick()  # this server holds the evictor lease while it clears
        c.clear(all_namespaces=True)
        store = TensorStoreL3(spec)
        assert store.list_keys(PAGES) == sorted(k for k in foreign if k.startswith(PAGES))
        assert store.exists([INDEX, USAGE]) == [False, False] and store.list_keys(JOURNAL) == [
            k for k in sorted(foreign) if k.startswith(JOURNAL)
        ]
        assert store.exists([MARKER, LEASE]) == [True, True]  # the layout and a live evictor's lease stay
    _intact(spec, foreign)


def test_owned_keys_of_a_namespace_are_its_pages_under_every_salt(filled):
    spec, written, _ = filled
    store = TensorStoreL3(spec)
    assert own_scope(A_SALTED) == own_scope(A) != own_scope(B)
    assert sorted(owned_keys(store, own_scope(A))) == sorted(written[A] + written[A_SALTED])
    everything = owned_keys(store)
    assert set(everything) == {
        *written[A],
        *written[A_SALTED],
        *written[B],
        INDEX,
        USAGE,
        *store.list_keys(JOURNAL),
    } - {
        "meta/journal/notes.txt",
        "meta/journal/12-x-1",
    }


def test_clear_past_its_deadline_stops_and_says_how_far(filled):
    spec, written, foreign = filled
    store = TensorStoreL3(spec)
    with pytest.raises(TimeoutError, match="after 0 of 6 keys"):
        clear(store, own_scope(A), deadline=time.monotonic() - 1)
    assert store.exists(written[A]) == [True] * 3
    assert clear(store, own_scope(A), batch=2) == 6  # clearing again finishes the job
    _intact(spec, foreign)


def test_namespace_clear_drops_only_its_rows_from_the_evictors_index(filled):
    spec, written, _ = filled
    with StorageClient(TensorStoreL3(spec), A, capacity=TRACKED) as c:
        c.capacity.tick()  # the evictor: its index holds every page
        assert c.capacity.index.pages == 9
        c.write_async(_pages(A, 4))  # touches not yet journaled when the clear comes
        assert c.flush(10)
        c.clear()
        c.capacity.tick()
        dirs = {d for d, r in c.capacity.index.report().items() if r["pages"]}
        assert dirs == {namespace_dir(B)} and c.capacity.index.pages == 3


def test_gc_sweeps_and_rebuild_ignore_foreign_files(filled):
    spec, written, foreign = filled
    store = TensorStoreL3(spec)
    collector = gc.Collector(store, quiet=True)
    assert collector.rebuild()["pages"] == 9  # pages only: no foreign file is indexed
    at = collector.select(namespace=namespace_dir(A).rsplit("/", 1)[0])
    out = collector.sweep(at, dry_run=False, namespace=namespace_dir(A).rsplit("/", 1)[0])
    assert out["pages"] == 6
    assert store.exists(written[A] + written[A_SALTED]) == [False] * 6
    _intact(spec, foreign)
    # A namespace sweep also finds pages the index does not hold, and still only pages.
    store.put([(k, b"x") for k in written[A]])
    collector.rebuild()
    collector.index.remove(collector.index.select(namespace_dir(A)))
    out = collector.sweep(
        collector.select(namespace=namespace_dir(A)), dry_run=False, namespace=namespace_dir(A)
    )
    assert out["unindexed_pages"] == 3 and store.exists(written[A]) == [False] * 3
    assert collector.sweep(collector.select(max_bytes=0), dry_run=False)["pages"] == 3  # model B
    collector.close()
    _intact(spec, foreign)
