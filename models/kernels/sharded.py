"""Kernels run per tensor-parallel shard: ``shard_map`` over the head axis.

Attention and the SSD scan are independent per head, so each device runs the unchanged
kernel (either backend) on its own heads and the KV pages or states of those heads; no
collective runs inside. Without a mesh these return the kernel itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hicache_jax.models.sharding import AXIS, tp_size

_HEADS = P(None, AXIS, None)  # [T, heads, D]
_PAGES = P(None, None, AXIS, None)  # [num_pages, page_size, kv_heads, D]
_STATES = P(None, AXIS)  # [num_slots, heads, P, N] (GDN: [num_slots, heads, Dk, Dv])


def _per_shard(fn: Callable, mesh: Mesh, in_specs: tuple, out_specs) -> Callable:
    # Pallas calls carry no varying-axis annotations, hence check_vma=False.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def attention(fn: Callable, mesh: Mesh | None, sinks: bool = False, **static) -> Callable:
    """``fn(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, num_seqs[, sinks])`` per
    shard (``sinks``: the call passes each query head's sink logit, split as the heads are)."""
    fn = functools.partial(fn, **static)
    if mesh is None:
        return fn
    specs = (_HEADS, _PAGES, _PAGES, P(), P(), P(), P()) + ((P(AXIS),) if sinks else ())
    return _per_shard(fn, mesh, specs, _HEADS)


def latent_attention(fn: Callable, mesh: Mesh | None, **static) -> Callable:
    """``fn(q, pages, pages, kv_lens, page_tables, cu_q_lens, num_seqs)`` per shard for
    MLA: the queries split by head, the latent pages (one KV head every query head reads)
    whole on every device. ``return_lse=True``: the log-sum-exp ``[T, heads]`` too, split
    as the heads are (DeepSeek V4's window, its one K=V head replicated)."""
    fn = functools.partial(fn, **static)
    if mesh is None:
        return fn
    out = (_HEADS, P(None, AXIS)) if static.get("return_lse") else _HEADS
    return _per_shard(fn, mesh, (_HEADS, P(), P(), P(), P(), P(), P()), out)


def row_attention(fn: Callable, mesh: Mesh | None, **static) -> Callable:
    """``fn(q, pages, table, seq, idx) -> (o, lse)`` per shard: the queries (and the
    output and log-sum-exp) split by head, the pool, table and row lists whole on every
    device (DeepSeek V4's K=V rows are replicated)."""
    fn = functools.partial(fn, **static)
    if mesh is None:
        return fn
    return _per_shard(fn, mesh, (_HEADS, P(), P(), P(), P()), (_HEADS, P(None, AXIS)))


def replicated(fn: Callable, mesh: Mesh | None, num_args: int, **static) -> Callable:
    """``fn`` run whole on every device: its ``num_args`` inputs and its output replicated
    (a lightning indexer's queries, weights and keys, which tensor parallelism does not
    split). ``shard_map`` keeps the partitioner away from the Pallas call."""
    fn = functools.partial(fn, **static)
    if mesh is None:
        return fn
    return _per_shard(fn, mesh, (P(),) * num_args, P())


def kv_write(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn(k_pages, v_pages, k, v, slot_mapping) -> (k_pages, v_pages)`` per shard."""
    if mesh is None:
        return fn
    return _per_shard(fn, mesh, (_PAGES, _PAGES, _HEADS, _HEADS, P()), (_PAGES, _PAGES))


def ssd(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn(x, dt, A, B, C, D, cu_seqlens, num_seqs, states, slots, has_initial_state)``
    per shard. With fewer B/C groups than shards, each shard's heads lie in one group, so
    the groups are repeated to one per shard first."""
    if mesh is None:
        return fn
    tp = tp_size(mesh)
    specs = (_HEADS, P(None, AXIS), P(AXIS), _HEADS, _HEADS, P(AXIS), P(), P(), _STATES, P(), P())
    inner = _per_shard(fn, mesh, specs, (_HEADS, _STATES))

    def run(x, dt, A, B, C, D, *rest):
        G = B.shape[1]
        if G < tp:
            B, C = jnp.repeat(B, tp // G, axis=1), jnp.repeat(C, tp // G, axis=1)
        return inner(x, dt, A, B, C, D, *rest)

    return run


def gdn(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn(q, k, v, g, beta, cu_seqlens, num_seqs, states, slots, has_initial_state)`` per
    shard: q, k (already repeated to the value heads), v, g, beta and the states split on
    the value heads."""
    if mesh is None:
        return fn
    per_head = P(None, AXIS)  # [T, heads]
    specs = (_HEADS, _HEADS, _HEADS, per_head, per_head, P(), P(), _STATES, P(), P())
    return _per_shard(fn, mesh, specs, (_HEADS, _STATES))
