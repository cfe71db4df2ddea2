"""``storage.gc`` reports pages and bytes per KV page dtype (issue 46): namespaces of several
dtypes, scale schemes and salts on one store, against a listing of the store. A namespace
whose fields are hashed in its directory name (too long for a path: a scale digest with a
long dtype name, a page-auth id) is named by a KV page's header, never by a state page
(which keeps its own dtype)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.storage import gc
from hicache_jax.storage.capacity import CapacityConfig
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import PAGES, namespace_dir, page_path, parse_page_path
from hicache_jax.storage.tensorstore_store import TensorStoreL3
from tests.waits import wait

REPO = Path(__file__).resolve().parents[2]
P = 4
DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "int8": np.int8,
}
# Wide dtypes have no scheme; 8-bit ones "tensor-1" (unit scales) or a calibrated digest
# (with a float8 name, the fields pass a path token's length: the dir is hashed).
SCHEMES = {"float32": [None], "bfloat16": [None]} | {
    d: ["tensor-1", "tensor-0123456789ab"] for d in ("float8_e4m3fn", "float8_e5m2", "int8")
}

namespaces = st.lists(
    st.sampled_from(sorted(DTYPES)).flatmap(
        lambda d: st.tuples(st.just(d), st.sampled_from(SCHEMES[d]), st.sampled_from([None, "tenant"]))
    ),
    min_size=1,
    max_size=4,
    unique=True,
)


def fill(spec: str, spaces) -> dict[str, str]:
    """Write 2-4 KV pages and one float32 state page per namespace; {ns dir: its kv dtype}."""
    truth = {}
    client = None
    for i, (dtype, scheme, salt) in enumerate(spaces):
        ns = Namespace(f"model{i % 2}", dtype, P, 1, cache_salt=salt, kv_scales=scheme)
        if client is None:
            client = StorageClient(
                TensorStoreL3(spec), ns, capacity=CapacityConfig(max_bytes=10**9, tick_s=60, lease_ttl_s=600)
            )
        tokens = np.random.default_rng(i).integers(0, 1000, P * (2 + i % 3))
        hashes = page_hashes(tokens, P, ns)
        # The state page first, in a journal segment of its own: the oldest of its namespace,
        # the first page a reader that ignored kinds would pick.
        state = np.ones(64 + i, np.float32)
        client.write_async([(page_path(ns, hashes[-1], "state"), {"state": state})], ns)
        assert client.flush(10)
        client.capacity.tick()
        items = [(page_path(ns, h, "kv"), {"kv": np.ones((2, P, 8), DTYPES[dtype])}) for h in hashes]
        client.write_async(items, ns)
        assert client.flush(10)
        truth[namespace_dir(ns)] = dtype
    client.capacity.tick()
    client.close()
    return truth


def listing(spec: str, truth: dict[str, str]) -> dict[str, dict]:
    """Reference: {kv dtype: pages, bytes} from listing and reading every page."""
    store = TensorStoreL3(spec)
    keys = store.list_keys(PAGES)
    out: dict[str, dict] = {}
    for key, value in zip(keys, store.get(keys)):
        row = out.setdefault(truth[parse_page_path(key).ns_dir], {"pages": 0, "bytes": 0})
        row["pages"] += 1
        row["bytes"] += len(value)
    store.close()
    return out


@settings(max_examples=12, deadline=None)
@given(spaces=namespaces)
def test_report_per_dtype_matches_a_listing(spaces):
    with tempfile.TemporaryDirectory() as tmp:
        spec = str(Path(tmp) / "l3")
        truth = fill(spec, spaces)
        want = listing(spec, truth)
        store = TensorStoreL3(spec)
        c = gc.Collector(store, quiet=True)
        try:
            got = c.report()["kv_dtypes"]
        finally:
            c.close()
            store.close()
        assert {d: (r["pages"], r["bytes"]) for d, r in got.items()} == {
            d: (r["pages"], r["bytes"]) for d, r in want.items()
        }
        for r in got.values():
            assert r["bytes_per_page"] == r["bytes"] / r["pages"]


def test_cli_reports_dtypes(tmp_path):
    """``python -m hicache_jax.storage.gc --json`` (and its table) name every dtype, that of
    a namespace with hashed fields too."""
    spec = str(tmp_path / "l3")
    truth = fill(
        spec,
        [
            ("bfloat16", None, None),
            ("float8_e4m3fn", "tensor-1", None),
            ("int8", "tensor-0123456789ab", None),
            ("float8_e5m2", "tensor-0123456789ab", "tenant"),
        ],
    )
    assert sum(d.split("/")[1].startswith("h-") for d in truth) == 1  # the e5m2 one
    run = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "hicache_jax.storage.gc", f"--spec={spec}", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=wait(60),
    )
    done = run("--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])["report"]
    assert {d: r["pages"] for d, r in report["kv_dtypes"].items()} == {
        d: r["pages"] for d, r in listing(spec, truth).items()
    }
    table = run()
    assert table.returncode == 0, table.stderr[-2000:]
    for dtype in ("bfloat16", "float8_e4m3fn", "int8", "float8_e5m2"):
        assert f"kv_dtype={dtype}" in table.stdout, table.stdout
