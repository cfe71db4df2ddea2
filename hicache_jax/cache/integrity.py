"""The prefix cache checks itself (STYLE 11): trees consistent, the eviction order and
``storage_rows`` what the nodes say, every pool consistent, and every used index owned
exactly once, by a tree or by a running request. Cheap enough to call when idle
(``/flush_cache`` does); tests call it after every operation."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache_jax.cache.prefix_cache import PrefixCache


def indices(cache: PrefixCache) -> dict[str, list[int]]:
    """Every device and host index the trees hold, by pool (host pools as ``host_<kind>``)."""
    out: dict[str, list[int]] = {k: [] for k in cache.pools}
    out.update({"host_" + k: [] for k in cache.host})
    for node in cache.nodes():
        for kind in cache.pools:
            if getattr(node, kind) is not None:
                out[kind].append(getattr(node, kind))
        for kind in cache.host:
            if getattr(node, "host_" + kind) is not None:
                out["host_" + kind].append(getattr(node, "host_" + kind))
    return out


def check_integrity(cache: PrefixCache, held_outside: dict[str, list[int]] | None = None) -> None:
    """Raises AssertionError naming the first inconsistency; ``held_outside``: the indices
    the running requests own, by pool."""
    for t in cache.trees.values():
        t.check_integrity()
    everything = list(cache.nodes())
    cache.eviction.check(everything)
    rows = sum(getattr(n, "host_" + k) is not None for n in everything if n.from_storage for k in cache.host)
    if rows != cache.storage_rows:
        raise AssertionError(f"storage_rows {cache.storage_rows}, but nodes from L3 hold {rows} host rows")
    held_outside = held_outside or {}
    owned = indices(cache)
    all_pools = dict(cache.pools) | {"host_" + k: h.index for k, h in cache.host.items()}
    for kind, pool in all_pools.items():
        pool.check_integrity()
        owners = owned[kind] + list(held_outside.get(kind, []))
        if len(owners) != len(set(owners)):
            dup = sorted({i for i in owners if owners.count(i) > 1})[:8]
            raise AssertionError(f"{pool.name}: indices owned twice: {dup}")
        if set(owners) != pool.used():
            leaked = sorted(pool.used() - set(owners))[:8]
            unalloc = sorted(set(owners) - pool.used())[:8]
            raise AssertionError(f"{pool.name}: leaked {leaked}, owned but not allocated {unalloc}")
