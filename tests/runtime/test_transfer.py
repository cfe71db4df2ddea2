"""Page transfers: chunked, padded copies match plain indexing, both ways."""

import types

import jax
import numpy as np

from hicache_jax.models.cache import KVPages, MambaState
from hicache_jax.models.presets import preset_config
from hicache_jax.runtime.transfer import MIN_PAGES, PageTransfer

PAGES, SLOTS = 40, 24


def _runner(rng):
    """What PageTransfer reads of a ModelRunner: the config and the cache, here random."""
    cfg = preset_config("tiny-mamba")
    m = cfg.mamba

    def rand(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(np.float32))

    cache = tuple(
        MambaState(
            rand(SLOTS, m.conv_kernel - 1, m.conv_dim), rand(SLOTS, m.num_heads, m.head_dim, m.state_size)
        )
        if kind == "mamba"
        else KVPages(
            rand(PAGES, 16, cfg.num_kv_heads, cfg.head_dim), rand(PAGES, 16, cfg.num_kv_heads, cfg.head_dim)
        )
        for kind in cfg.layer_kinds
    )
    model = types.SimpleNamespace(cache_shardings=lambda: None, mesh=None)  # one device: no mesh
    return types.SimpleNamespace(cfg=cfg, cache=cache, model=model)


def _rows(runner, transfer, kind, idx) -> dict[str, np.ndarray]:
    """The reference: host rows by numpy indexing of the device arrays."""
    entries = [runner.cache[i] for i in transfer.layers[kind]]
    if kind == "mamba":
        return {f: np.stack([np.asarray(getattr(e, f))[idx] for e in entries], 1) for f in MambaState._fields}
    return {"kv": np.stack([np.stack([np.asarray(e.k)[idx], np.asarray(e.v)[idx]], 1) for e in entries], 1)}


def test_buckets_are_bounded_by_the_device_and_the_chunk_bytes():
    runner = _runner(np.random.default_rng(0))
    assert PageTransfer(runner).buckets("full") == [8, 16, 32, 64]  # 40 device pages
    assert PageTransfer(runner).buckets("mamba") == [8, 16, 32]  # 24 slots
    page = 16 * 2 * 16 * 4 * 2  # one layer's k and v of a page, float32
    assert PageTransfer(runner, chunk_bytes=16 * page).buckets("full") == [8, 16]
    assert PageTransfer(runner, chunk_bytes=1).buckets("full") == [MIN_PAGES]


def test_chunked_read_and_write_match_indexing():
    rng = np.random.default_rng(0)
    runner = _runner(rng)
    transfer = PageTransfer(runner, chunk_bytes=1)  # chunks of MIN_PAGES
    for kind, n in (("full", PAGES), ("mamba", SLOTS)):
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
