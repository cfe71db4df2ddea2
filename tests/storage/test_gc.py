"""The offline L3 tool: report by namespace and age, and sweeps (dry and real) to a size, an
age and a namespace, checked against a listing of the store."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_jax.storage import gc
from hicache_jax.storage.capacity import CapacityConfig
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.layout import PAGES, namespace_dir, parse_page_path
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.storage.test_capacity import NS, chain, pages
from tests.waits import wait

REPO = Path(__file__).resolve().parents[2]
SALTED = NS.with_salt("tenant-b")


def _listing(store) -> dict[str, int]:
    """Reference: namespace dir -> bytes, from listing and reading every page."""
    out: dict[str, int] = {}
    keys = store.list_keys(PAGES)
    for key, value in zip(keys, store.get(keys)):
        d = parse_page_path(key).ns_dir
        out[d] = out.get(d, 0) + len(value)
    return out


@pytest.fixture
def filled(tmp_path):
    """A store served with tracking on: 3 chains of NS, then 2 of a salted namespace."""
    spec = str(tmp_path / "l3")
    client = StorageClient(
        TensorStoreL3(spec), NS, capacity=CapacityConfig(max_bytes=10**9, tick_s=60, lease_ttl_s=600)
    )
    for s in range(3):
        client.write_async(pages(s, 4))
        assert client.flush(10)
        client.capacity.tick()  # one journal object per chain: distinct ages
    for s in (10, 11):
        salted = [(k.replace(namespace_dir(NS), namespace_dir(SALTED)), a) for k, a in pages(s, 4)]
        client.write_async(salted, SALTED)
        assert client.flush(10)
        client.capacity.tick()
    client.close()
    return spec


def test_report_matches_a_listing(filled):
    store = TensorStoreL3(filled)
    c = gc.Collector(store, quiet=True)
    report = c.report()
    want = _listing(store)
    assert {d: r["bytes"] for d, r in report["namespaces"].items()} == want
    assert report["pages"] == 20 and report["bytes"] == sum(want.values())
    for r in report["namespaces"].values():
        assert r["by_age"]["<1h"] == r["bytes"]  # all written just now
    c.close()


def test_sweep_to_size_dry_run_then_real(filled):
    store = TensorStoreL3(filled)
    c = gc.Collector(store, quiet=True)
    total = c.report()["bytes"]
    at = c.select(max_bytes=total // 2)
    dry = c.sweep(at, dry_run=True)
    assert dry["pages"] >= 10 and sum(_listing(store).values()) == total  # nothing removed
    done = c.sweep(at, dry_run=False)
    assert sum(_listing(store).values()) <= total // 2 and done["bytes"] == dry["bytes"]
    client = StorageClient(TensorStoreL3(filled), NS)
    assert client.match_prefix(chain(0, 4)) == 0  # the oldest went
    client.close()
    c.close()


def test_sweep_a_namespace_keeps_the_others(filled):
    store = TensorStoreL3(filled)
    c = gc.Collector(store, quiet=True)
    before = _listing(store)
    out = c.sweep(c.select(namespace=namespace_dir(SALTED)), dry_run=False, namespace=namespace_dir(SALTED))
    assert out["pages"] == 8 and _listing(store) == {namespace_dir(NS): before[namespace_dir(NS)]}
    c.close()


def test_rebuild_and_sweep_by_age(filled):
    """Pages of chain 0 are made 2 days old on disk; --rebuild takes ages from mtimes."""
    store = TensorStoreL3(filled)
    old = time.time() - 2 * 86400
    for key in chain(0, 4):
        os.utime(os.path.join(filled, key), (old, old))
    c = gc.Collector(store, quiet=True)
    assert c.rebuild()["pages"] == 20
    at = c.select(older_than_s=gc.parse_age("1d"))
    assert sorted(c.index.paths(at)) == sorted(chain(0, 4))
    c.sweep(at, dry_run=False)
    assert store.exists(chain(0, 4)) == [False] * 4 and store.exists(chain(1, 4)) == [True] * 4
    c.close()


def test_cli_dry_run_and_sweep(filled):
    run = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "hicache_jax.storage.gc", f"--spec={filled}", "--json", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=wait(60),
    )
    dry = run("--max_gb=0", "--dry_run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    out = json.loads(dry.stdout.strip().splitlines()[-1])
    assert out["sweep"]["pages"] == 20 and out["report"]["pages"] == 20
    real = run(f"--namespace={namespace_dir(SALTED)}")
    assert real.returncode == 0, real.stderr[-2000:]
    assert json.loads(real.stdout.strip().splitlines()[-1])["report"]["pages"] == 12
    with pytest.raises(ValueError, match="bad age"):
        gc.parse_age("soon")
