"""The TensorStore L3 backend on memory:// and on a file directory, and across processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_jax.storage.base import make_store
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import page_path
from hicache_jax.storage.tensorstore_store import InvalidStoreSpec, TensorStoreL3, resolve_spec
from tests.waits import wait

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    spec = "memory://" if request.param == "memory" else str(tmp_path / "l3")
    s = make_store("tensorstore", spec)
    yield s
    s.close()


def test_put_get_exists_delete(store):
    assert store.get(["a.kv", "b.kv"]) == [None, None]
    assert store.put([("a.kv", b"alpha"), ("b.kv", b"")]) == 2
    assert store.exists(["a.kv", "b.kv", "c.kv"]) == [True, True, False]
    assert store.get(["b.kv", "c.kv", "a.kv"]) == [b"", None, b"alpha"]
    store.delete(["a.kv", "missing.kv"])
    assert store.exists(["a.kv", "b.kv"]) == [False, True]
    stats = store.stats()
    assert stats["pages_written"] == 2 and stats["misses"] == 3 and stats["pages_read"] == 2
    assert stats["bytes_read"] == 5 and stats["bytes_written"] == 5


def test_put_skips_existing_unless_forced(store):
    assert store.put([("a.kv", b"one")]) == 1
    assert store.put([("a.kv", b"two"), ("b.kv", b"bee"), ("b.kv", b"bee")]) == 1
    assert store.get(["a.kv"]) == [b"one"]
    assert store.stats()["skipped_puts"] == 2
    assert store.put([("a.kv", b"two")], force=True) == 1
    assert store.get(["a.kv"]) == [b"two"]


def _pages(n):
    ns = Namespace("tiny", "bfloat16", 4, 1)
    return [page_path(ns, h, "kv") for h in page_hashes(range(4 * n), 4, ns)]


def test_clear_deletes_only_pages_of_the_layout(store):
    pages, foreign = _pages(5), [f"{i}.kv" for i in range(5)]
    store.put([(k, b"x") for k in pages + foreign])
    assert store.clear() == 5
    assert store.exists(pages) == [False] * 5 and store.exists(foreign) == [True] * 5
    assert store.clear() == 0  # clearing an empty store is a no-op


def test_clear_removes_only_its_prefix(tmp_path):
    outer = TensorStoreL3(str(tmp_path))
    inner = TensorStoreL3(str(tmp_path / "inner"))
    keep, drop = _pages(2)
    outer.put([(keep, b"1")])
    inner.put([(drop, b"2")])
    inner.clear()
    assert outer.get([keep]) == [b"1"]
    assert inner.get([drop]) == [None]


def test_closed_store_refuses_calls(store):
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.get(["a.kv"])
    store.close()


@pytest.mark.parametrize("bad_key", ["", "/abs.kv", "../up.kv"])
def test_bad_keys_rejected(store, bad_key):
    with pytest.raises(ValueError, match="invalid L3 key"):
        store.put([(bad_key, b"x")])


def test_spec_forms_share_one_file_store(tmp_path):
    d = tmp_path / "l3"
    by_path = TensorStoreL3(str(d), file_io_concurrency=8)
    by_path.put([("k.kv", b"v")])
    by_url = TensorStoreL3(f"file://{d}")
    by_dict = TensorStoreL3({"driver": "file", "path": str(d)})
    by_json = TensorStoreL3(json.dumps({"driver": "file", "path": str(d) + "/"}))
    for s in (by_url, by_dict, by_json):
        assert s.get(["k.kv"]) == [b"v"]
    assert (d / "k.kv").is_file()  # the key sits inside the directory, not beside it


def test_resolve_spec():
    assert resolve_spec("gs://bucket/prefix") == {"driver": "gcs", "bucket": "bucket", "path": "prefix/"}
    assert resolve_spec("memory://") == {"driver": "memory"}
    local = resolve_spec("rel/dir")
    assert local["path"] == os.path.abspath("rel/dir") + "/" and local["file_io_sync"] is False
    assert resolve_spec({"driver": "file", "path": "/x", "file_io_sync": True})["file_io_sync"]


@pytest.mark.parametrize(
    "spec",
    ["nonsense://bucket", '{"driver": "file"', {"driver": "no-such-driver"}, {"path": "/x"}, ""],
)
def test_bad_spec_names_the_spec(spec):
    with pytest.raises(InvalidStoreSpec) as info:
        TensorStoreL3(spec)
    if spec:
        assert (str(spec) if isinstance(spec, str) else repr(spec)[:10]) in str(info.value)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown L3 backend"):
        make_store("nope", "memory://")


def test_two_processes_share_a_file_store_without_torn_reads(tmp_path):
    d = str(tmp_path / "shared")
    TensorStoreL3(d)  # create nothing yet; both workers open the same directory
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.storage._rw_worker", d, str(i), "3.0"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=wait(600))
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["reads"] > 0 and r["writes"] > 0
        assert r["corrupt"] == 0 and r["torn"] == 0 and r["missing"] == 0, r
    # Each process read pages the other one wrote: the store really was shared.
    assert sum(r["foreign"] for r in results) > 0, results


def test_results_keep_input_order_across_read_windows(tmp_path):
    store = TensorStoreL3(str(tmp_path), max_in_flight=2)
    keys = [f"{i:03d}.kv" for i in range(11)]
    store.put([(k, k.encode() * (i + 1)) for i, k in enumerate(keys[::2])])
    order = keys[::-1] + keys
    got = store.get(order)
    assert got == [k.encode() * (keys[::2].index(k) + 1) if k in keys[::2] else None for k in order]
    assert store.exists(order) == [g is not None for g in got]
