"""Page transfers: chunked, padded copies match plain indexing, both ways."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from hicache_jax.models.cache import allocate_cache
from hicache_jax.models.config import GdnConfig
from hicache_jax.models.presets import preset_config
from hicache_jax.runtime.transfer import MIN_PAGES, PageTransfer

PAGES, SLOTS = 40, 24


def _config(mixed: bool):
    cfg = preset_config("tiny-mamba")
    if mixed:  # two recurrent kinds with different state shapes in one snapshot
        gdn = GdnConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=12, conv_kernel=4)
        cfg = dataclasses.replace(cfg, layer_kinds=("mamba", "gdn", "attention", "gdn"), gdn=gdn)
    return cfg


def _runner(rng, mixed: bool = False):
    """What PageTransfer reads of a ModelRunner: the config and the cache, here random."""
    cfg = _config(mixed)
    zeros = allocate_cache(cfg, num_pages=PAGES, page_size=16, num_state_slots=SLOTS)
    cache = jax.tree_util.tree_map(
        lambda a: jax.device_put(rng.standard_normal(a.shape).astype(np.float32)), zeros
    )
    model = types.SimpleNamespace(cache_shardings=lambda: None, mesh=None)  # one device: no mesh
    return types.SimpleNamespace(cfg=cfg, cache=cache, model=model)


def _rows(runner, transfer, kind, idx) -> dict[str, np.ndarray]:
    """The reference: host rows by numpy indexing of the device arrays."""
    if kind == "state":  # per recurrent layer kind, its layers' fields stacked
        out = {}
        for layer_kind in ("gdn", "mamba"):
            entries = [e for e, k in zip(runner.cache, runner.cfg.layer_kinds) if k == layer_kind]
            for f in ("conv", "ssm") if entries else ():
                out[f"{layer_kind}.{f}"] = np.stack([np.asarray(getattr(e, f))[idx] for e in entries], 1)
        return out
    entries = [runner.cache[i] for i in transfer.layers[kind]]
    return {"kv": np.stack([np.stack([np.asarray(e.k)[idx], np.asarray(e.v)[idx]], 1) for e in entries], 1)}


def test_buckets_are_bounded_by_the_device_and_the_chunk_bytes():
    runner = _runner(np.random.default_rng(0))
    assert PageTransfer(runner).buckets("full") == [8, 16, 32, 64]  # 40 device pages
    assert PageTransfer(runner).buckets("state") == [8, 16, 32]  # 24 slots
    page = 16 * 2 * 16 * 4 * 2  # one layer's k and v of a page, float32
    assert PageTransfer(runner, chunk_bytes=16 * page).buckets("full") == [8, 16]
    assert PageTransfer(runner, chunk_bytes=1).buckets("full") == [MIN_PAGES]


@pytest.mark.parametrize("mixed", [False, True], ids=["mamba", "mamba+gdn"])
def test_chunked_read_and_write_match_indexing(mixed):
    rng = np.random.default_rng(0)
    runner = _runner(rng, mixed)
    transfer = PageTransfer(runner, chunk_bytes=1)  # chunks of MIN_PAGES
    for kind, n in (("full", PAGES), ("state", SLOTS)):
        idx = rng.permutation(n)[:19].tolist()  # three chunks, the last one padded
        got = transfer.read(kind, idx)
        want = _rows(runner, transfer, kind, idx)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
        new = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in want.items()}
        untouched = sorted(set(range(n)) - set(idx))
        before = _rows(runner, transfer, kind, untouched)
        transfer.write(kind, idx, new)
        for k, v in _rows(runner, transfer, kind, idx).items():
            np.testing.assert_array_equal(v, new[k])
        for k, v in _rows(runner, transfer, kind, untouched).items():
            np.testing.assert_array_equal(v, before[k])  # padding wrote nowhere
