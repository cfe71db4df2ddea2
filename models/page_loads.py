"""KV pages that arrive from host memory during a step, layer by layer.

An L2 hit's pages can reach the device in two ways (``runtime/transfer.py``): a scatter
program before the step, or inside the step itself. Here is the second. The step takes
each attention layer's pages as arrays in host memory (``pinned_host``); just before layer
``i`` runs, its pages are copied to the device and written into its cache. Each layer's
copy is tied to the activations entering that layer (``optimization_barrier``), so XLA
cannot write the pages before the earlier layers ran. The copies themselves can start at
once. On TPU the scheduled program starts every layer's host-to-device copy up front and
waits for layer ``i``'s copy only where layer ``i`` begins: the copies of later layers run
while earlier layers compute (``tests/tpu/test_serving_step.py`` checks that order).

Shapes are fixed: ``capacity`` pages per page group, whether or not that many arrived.
Unused rows carry an index past the pool, and the write drops them. A layer that pages
several cache kinds (``models/cache.py``, ``paged_specs``) gets each kind's pages.
"""

from __future__ import annotations

import dataclasses

import jax

from hicache_jax.models.cache import PagedSpec, join, parts


@dataclasses.dataclass(frozen=True)
class PageLoads:
    idx: dict  # page group -> [capacity] int32 device page indices (past the pool: none)
    # Per layer: {page group: its entry of [capacity, rows, *per_row] arrays in host
    # memory}, or None.
    pages: tuple


jax.tree_util.register_dataclass(PageLoads, data_fields=["idx", "pages"], meta_fields=[])


def land(entry, x: jax.Array, loads: PageLoads, layer: int, specs: tuple[PagedSpec, ...]):
    """Layer ``layer``'s loaded pages, copied to the device and written into ``entry``
    once ``x`` (the layer's input) exists. Returns the entry and ``x`` (unchanged)."""
    arrived = {
        g: [jax.device_put(a, jax.memory.Space.Device) for a in e] for g, e in loads.pages[layer].items()
    }
    x, arrived = jax.lax.optimization_barrier((x, arrived))
    out = []
    for spec, part in zip(specs, parts(entry, specs)):
        if spec.kind not in arrived:
            out.append(part)
            continue
        idx = loads.idx[spec.kind]
        new = arrived[spec.kind]
        out.append(type(part)(*(a.at[idx].set(n.astype(a.dtype), mode="drop") for a, n in zip(part, new))))
    return join(out, specs), x
