"""A drafting block's KV in the paged cache (``ModelConfig.mtp_cache_layers``): with it set,
the cache has one more entry, after the main layers', allocated, sharded, paged and counted
as a main layer of the block's kind, carried bit for bit through L2 (device pages -> host
pool -> other device pages) and L3 (a TensorStore directory), under an L3 namespace of its
own; without it, everything is as before. On a DeepSeek V3-style (MLA) model and a
Qwen3-Next-style one (Gated DeltaNet layers and gated full attention)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.cache.host_pool import HostPool
from hicache_jax.kinds import L3_SUFFIX
from hicache_jax.models.cache import allocate_cache, layer_specs, paged_specs
from hicache_jax.models.config import ModelConfig, NextNConfig
from hicache_jax.models.layers.mtp_nextn import block_config
from hicache_jax.models.page_bytes import page_bytes
from hicache_jax.models.presets import preset_config
from hicache_jax.models.sharding import cache_shardings, kv_heads_on_device, make_mesh
from hicache_jax.runtime.transfer import PageTransfer
from hicache_jax.storage import gc
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.keys import Namespace, page_hashes
from hicache_jax.storage.layout import namespace_dir, page_path
from hicache_jax.storage.tensorstore_store import TensorStoreL3

P, PAGES, SLOTS = 16, 40, 8


def family_config(family: str, mtp_cache_layers: int = 1) -> ModelConfig:
    """The family's tiny preset with one MTP block (the block's layer: MLA with an MoE MLP,
    or gated full attention)."""
    if family == "deepseek_v3":
        base, nextn = preset_config("tiny-mla"), NextNConfig(1, "mla", True, "deepseek")
    else:
        base, nextn = preset_config("tiny-qwen3.5"), NextNConfig(1, "attention", False, "qwen")
    return dataclasses.replace(base, nextn=nextn, mtp_cache_layers=mtp_cache_layers)


FAMILIES = ("deepseek_v3", "qwen3_next")


def shapes(tree):
    return jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), tree)


def same_kind_layer(cfg: ModelConfig) -> int:
    """The first main layer of the block's kind."""
    return cfg.layer_kinds.index(cfg.nextn.kind)


def test_mtp_cache_layers_is_checked_and_round_trips():
    cfg = family_config("deepseek_v3")
    assert cfg.cache_layer_kinds == (*cfg.layer_kinds, "mla")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict(family_config("deepseek_v3", 0).to_dict()).mtp_cache_layers == 0
    with pytest.raises(ValueError, match="mtp_cache_layers must be 0 or 1, got 2"):
        dataclasses.replace(cfg, mtp_cache_layers=2)
    with pytest.raises(ValueError, match="mtp_cache_layers=1 needs nextn"):
        dataclasses.replace(cfg, nextn=None)
    one = block_config(cfg)  # the block's own one-layer config drops the extra entry
    assert one.mtp_cache_layers == 0 and one.cache_layer_kinds == ("mla",)
    assert cfg.mtp_params() == family_config("deepseek_v3", 0).mtp_params()


@pytest.mark.parametrize("family", FAMILIES)
def test_without_it_the_layout_is_unchanged(family):
    """mtp_cache_layers=0 with MTP blocks: the cache, its specs, page bytes, host rows and
    shardings are those of the model without blocks."""
    cfg = family_config(family, 0)
    plain = dataclasses.replace(cfg, nextn=None)
    assert cfg.cache_layer_kinds == cfg.layer_kinds
    kw = dict(num_pages=PAGES, page_size=P, num_state_slots=SLOTS)
    assert shapes(allocate_cache(cfg, **kw)) == shapes(allocate_cache(plain, **kw))
    assert layer_specs(cfg) == layer_specs(plain)
    assert page_bytes(cfg, 2, P) == page_bytes(plain, 2, P)
    mesh = make_mesh(2)
    assert cache_shardings(cfg, mesh) == cache_shardings(plain, mesh)
    a, b = PageTransfer(runner(cfg, 1)), PageTransfer(runner(plain, 1))
    assert a.kinds() == b.kinds() and all(a.layout(k) == b.layout(k) for k in a.kinds())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_extra_entry_is_a_main_layer_of_the_blocks_kind(family):
    cfg, without = family_config(family), family_config(family, 0)
    n, same = cfg.num_layers, same_kind_layer(cfg)
    kw = dict(num_pages=PAGES, page_size=P, num_state_slots=SLOTS, dtype=jnp.bfloat16)
    cache, before = allocate_cache(cfg, **kw), allocate_cache(without, **kw)
    assert len(cache) == n + 1 and shapes(cache[:n]) == shapes(before)
    assert shapes(cache[n]) == shapes(cache[same])
    assert layer_specs(cfg)[n] == layer_specs(cfg)[same] == paged_specs(cfg, cfg.nextn.kind)
    mesh = make_mesh(2)
    sharded = cache_shardings(cfg, mesh)
    assert (
        len(sharded) == n + 1
        and sharded[n] == sharded[same]
        and sharded[:n] == cache_shardings(without, mesh)
    )
    # Page bytes grow by the extra entry's bytes per page (from its arrays), in its kind only.
    (spec,) = paged_specs(cfg, cfg.nextn.kind)
    entry_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(cache[n])) // PAGES
    grown, was = page_bytes(cfg, 2, P), page_bytes(without, 2, P)
    suffix = L3_SUFFIX[spec.kind]
    assert grown[suffix] - was[suffix] == entry_bytes > 0
    assert {k: v for k, v in grown.items() if k != suffix} == {k: v for k, v in was.items() if k != suffix}


def runner(cfg: ModelConfig, tp: int, seed: int = 0):
    """What PageTransfer reads of a ModelRunner: the config, the model's mesh and cache
    shardings, and a cache of random values (split over ``tp`` devices when ``tp > 1``)."""
    rng = np.random.default_rng(seed)
    mesh = make_mesh(tp) if tp > 1 else None
    kv_heads = kv_heads_on_device(cfg, tp) if mesh else None
    zeros = allocate_cache(cfg, num_pages=PAGES, page_size=P, num_state_slots=SLOTS, kv_heads=kv_heads)
    where = cache_shardings(cfg, mesh) if mesh else jax.tree_util.tree_map(lambda _: None, zeros)
    cache = jax.tree_util.tree_map(
        lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), s), zeros, where
    )
    model = types.SimpleNamespace(cache_shardings=lambda: None if mesh is None else where, mesh=mesh)
    return types.SimpleNamespace(cfg=cfg, cache=cache, model=model)


def mtp_rows(r, idx) -> np.ndarray:
    """The extra entry's pages ``idx`` as a host row's slice: ``[n, fields, rows, *per_row]``
    (no KV head is replicated at the tp sizes here)."""
    return np.stack([np.asarray(a)[idx] for a in r.cache[r.cfg.num_layers]], axis=1)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_l2_and_l3_carry_the_extra_entry_bit_for_bit(family, tp, tmp_path):
    """Device pages ``src`` -> host rows -> device pages ``dst``; then host rows -> an L3
    directory -> a second host pool -> device pages ``dst2``: the extra entry's values arrive
    each time (they were different there before), and under the namespace of a server
    without the entry none of the pages is found."""
    cfg = family_config(family)
    r = runner(cfg, tp)
    transfer = PageTransfer(r)
    (spec,) = paged_specs(cfg, cfg.nextn.kind)
    kind = spec.kind
    assert transfer.layers[kind][-1] == cfg.num_layers
    src, dst, dst2 = [3, 7, 11, 12], [20, 5, 30, 1], [9, 33, 2, 17]
    want = mtp_rows(r, src)
    for to in (dst, dst2):
        assert not np.array_equal(mtp_rows(r, to), want)
    layout = transfer.layout(kind)
    ((name, (row_shape, _)),) = layout.items()
    assert row_shape[0] == len(transfer.layers[kind]) == cfg.layer_kinds.count(cfg.nextn.kind) + 1
    host = HostPool(kind, 8, layout)
    rows = [4, 0, 6, 2]
    host.write(rows, transfer.read(kind, src))
    np.testing.assert_array_equal(host.arrays[name][rows][:, -1], want)
    transfer.write(kind, dst, host.read(rows))
    np.testing.assert_array_equal(mtp_rows(r, dst), want)

    ns = Namespace("tiny-model", "float32", P, 1, mtp_cache_layers=cfg.mtp_cache_layers)
    without = dataclasses.replace(ns, mtp_cache_layers=0)
    tokens = np.random.default_rng(1).integers(3, 500, len(src) * P)
    keys = [page_path(ns, h, L3_SUFFIX[kind]) for h in page_hashes(tokens, P, ns)]
    spec_dir = str(tmp_path / "l3")
    with StorageClient(TensorStoreL3(spec_dir), ns) as client:
        client.write_async([(k, host.page(row)) for k, row in zip(keys, rows)])
        assert client.flush(30)
        pages = client.prefetch(keys).result(timeout=30)
    assert len(pages) == len(keys)
    other = HostPool(kind, 8, layout)
    other.write([1, 2, 3, 4], {name: np.stack([p[name] for p in pages])})
    transfer.write(kind, dst2, other.read([1, 2, 3, 4]))
    np.testing.assert_array_equal(mtp_rows(r, dst2), want)
    theirs = [page_path(without, h, L3_SUFFIX[kind]) for h in page_hashes(tokens, P, without)]
    assert not set(theirs) & set(keys)
    with StorageClient(TensorStoreL3(spec_dir), without) as client:
        assert client.exists(theirs) == [False] * len(theirs)


def test_the_l3_namespace_names_the_extra_entry(tmp_path):
    """The namespace of a server with the entry differs from one without (digest, hence every
    page key, and directory); without it (0), the namespace is the one from before the field.
    The offline gc tool reports both and sweeps one, leaving the other."""
    fields = dict(model_fingerprint="m", kv_dtype="bfloat16", page_size=P, layout_version=1)
    old, zero = Namespace(**fields), Namespace(**fields, mtp_cache_layers=0)
    one = Namespace(**fields, mtp_cache_layers=family_config("qwen3_next").mtp_cache_layers)
    assert zero == old and zero.digest == old.digest and namespace_dir(zero) == namespace_dir(old)
    assert b"mtp_cache_layers" not in old.canonical_bytes() and "mtp" not in namespace_dir(old)
    assert one.digest != old.digest and namespace_dir(one) != namespace_dir(old)
    tokens = np.arange(2 * P)
    assert not set(page_hashes(tokens, P, one)) & set(page_hashes(tokens, P, old))
    for bad in (-1, 1.0, "1"):
        with pytest.raises(ValueError, match="mtp_cache_layers"):
            Namespace(**fields, mtp_cache_layers=bad)

    spec = str(tmp_path / "l3")
    for ns, n in ((old, 3), (one, 2)):
        items = [
            (page_path(ns, h, "kv"), {"kv": np.full((2, 4), i, np.float32)})
            for i, h in enumerate(page_hashes(np.arange(n * P), P, ns))
        ]
        with StorageClient(TensorStoreL3(spec), ns) as client:
            client.write_async(items)
            assert client.flush(30)
    c = gc.Collector(TensorStoreL3(spec), quiet=True)
    try:
        c.rebuild()
        report = c.report()["namespaces"]
        assert {d: r["pages"] for d, r in report.items()} == {namespace_dir(old): 3, namespace_dir(one): 2}
        d = namespace_dir(one)
        assert c.sweep(c.select(namespace=d), dry_run=False, namespace=d)["pages"] == 2
        assert {d: r["pages"] for d, r in c.report()["namespaces"].items()} == {namespace_dir(old): 3}
    finally:
        c.close()
