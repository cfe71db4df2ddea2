"""The prefix cache checks itself (STYLE 11): trees consistent, the eviction order and
``storage_rows`` what the nodes say, every pool consistent, and every used index owned
exactly once, by a tree or by a running request. Cheap enough to call when idle
(``/flush_cache`` does); tests call it after every operation."""

from __future__ import annotations

from hicache_jax.cache.holdings import Holdings


def indices(held: Holdings) -> dict[str, list[int]]:
    """Every device and host index the trees hold, by pool (host pools as ``host_<kind>``)."""
    out: dict[str, list[int]] = {k: [] for k in held.pools}
    out.update({"host_" + k: [] for k in held.host})
    for node in held.nodes():
        for kind, idx in node.dev.items():
            out[kind].append(idx)
        for kind, row in node.host.items():
            out["host_" + kind].append(row)
    return out


def check_integrity(held: Holdings, held_outside: dict[str, list[int]] | None = None) -> None:
    """Raises AssertionError naming the first inconsistency; ``held_outside``: the indices
    the running requests own, by pool."""
    for t in held.trees.values():
        t.check_integrity()
    everything = list(held.nodes())
    held.order.check(everything)
    rows = sum(len(n.host) for n in everything if n.from_storage)
    if rows != held.storage_rows:
        raise AssertionError(f"storage_rows {held.storage_rows}, but nodes from L3 hold {rows} host rows")
    held_outside = held_outside or {}
    owned = indices(held)
    all_pools = dict(held.pools) | {"host_" + k: h.index for k, h in held.host.items()}
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
