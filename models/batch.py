"""What one forward step reads besides the weights and the cache.

A step runs a *ragged* batch: the new tokens of ``num_seqs`` sequences laid end to end,
prefill chunks and single decode tokens alike::

    tokens     | seq 0 (prefill chunk) | seq 1 | seq 2 (chunk) | pad ... |
    cu_q_lens  0                       5       6               9         (then repeats 9)

Sequence ``s`` owns tokens ``cu_q_lens[s] : cu_q_lens[s+1]`` and, after the step, has
``kv_lens[s]`` tokens in the cache (the new ones included), so its first new token sits at
position ``kv_lens[s] - q_len[s]``.

Attention KV lives in pages. Each page group (a paged cache kind: ``CacheKind.FULL`` for
full-attention layers, ``CacheKind.SWA`` for sliding-window layers, ...) has its own page
table, so the engine may release sliding-window pages that fell out of the window while
full-attention pages stay.
``slot_mappings[group][t]`` is where token ``t``'s K/V goes (``page * page_size + offset``;
-1 writes nothing). Recurrent layers read and write per-sequence state slots.

Arrays have static shapes (padded to buckets by the engine); padding sequences have
``q_len = kv_len = 0`` and slot -1, padding tokens lie past ``cu_q_lens[num_seqs]``.
"""

from __future__ import annotations

import dataclasses

import jax

from hicache_jax.kinds import PAGED, CacheKind, cache_kinds, layer_cache


def page_group(kind: str) -> CacheKind:
    """The page group a layer kind that pages one cache kind (attention) keeps its KV in."""
    groups = [c for c in layer_cache(kind) if c in PAGED]
    if len(groups) != 1:
        raise ValueError(f"layer kind {kind!r} pages {len(groups)} cache kinds, not one")
    return groups[0]


def page_groups(layer_kinds) -> tuple[CacheKind, ...]:
    """The paged cache kinds a stack of layers uses (each has its page table)."""
    return tuple(k for k in cache_kinds(layer_kinds) if k in PAGED)


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    kv_lens: jax.Array  # [S] int32
    num_seqs: jax.Array  # [] int32
    page_tables: dict  # group -> [S, max_pages] int32
    slot_mappings: dict  # group -> [T] int32
    state_slots: jax.Array  # [S] int32, recurrent state slot per sequence (-1: none)
    has_initial_state: jax.Array  # [S] bool: read the slot's state (else start from zero)
    logits_indices: jax.Array  # [R] int32: token rows whose logits the step returns
    # [T] int32 or None: -1 where ``input_ids`` holds the token, else the row of the previous
    # step's sampled ids to feed (the overlap schedule; the runner resolves it on device).
    feed_rows: jax.Array | None = None
    # KV pages arriving from host memory in this step, written layer by layer just before
    # each layer runs (``page_loads.py``); None: none (they were written before the step).
    loads: object = None  # PageLoads | None
    # Static: every sequence contributes exactly one token (lets Mamba take the
    # one-step recurrence instead of the chunked scan).
    decode_only: bool = False


jax.tree_util.register_dataclass(
    ForwardBatch,
    data_fields=[
        "input_ids",
        "positions",
        "cu_q_lens",
        "kv_lens",
        "num_seqs",
        "page_tables",
        "slot_mappings",
        "state_slots",
        "has_initial_state",
        "logits_indices",
        "feed_rows",
        "loads",
    ],
    meta_fields=["decode_only"],
)
