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

A *verify step* (speculative decoding) carries ``state_trail`` ``[S, Q]``: each sequence
feeds at most ``Q`` tokens (its last sampled token and its drafts), and recurrent layers
write their state after token ``j`` of sequence ``s`` (conv and SSM alike) to the scratch
slot ``state_trail[s, j]`` (-1: none) besides leaving the working slot at the state after
the last token, so the engine keeps the accepted one without a re-run::

    sequence s     | t0 | t1 | t2 |            q_len[s] = 3, Q = 4
    state_trail[s] | a  | b  | -1 | (ignored)  slot a: state after t0, b: after t1
    state_slots[s] = w                         slot w: state after t2, as in any step

``check_state_trail`` says, on the host, what the layers need of it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

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
    # [S, Q] int32 or None: a verify step's trail slots (module docstring); None: an
    # ordinary step.
    state_trail: jax.Array | None = None
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
        "state_trail",
    ],
    meta_fields=["decode_only"],
)


def check_state_trail(state_trail, state_slots, cu_q_lens, num_seqs, num_slots: int | None = None) -> None:
    """Refuse, on the host, a trail the recurrent layers cannot honour, naming what is wrong:
    each live sequence feeds at most ``Q`` tokens; the trail slots a step writes (``j <
    q_len[s]``, ``>= 0``) are distinct, inside the pool and none is a working slot. A -1
    anywhere writes nothing, the last token's included (its state is the working slot's);
    a sequence without a working slot starts from zeros, as in an ordinary step."""
    trail, slots, cu = np.asarray(state_trail), np.asarray(state_slots), np.asarray(cu_q_lens)
    n = int(num_seqs)
    if trail.ndim != 2 or trail.shape[0] != slots.shape[0]:
        raise ValueError(f"state_trail has shape {trail.shape}; want [S={slots.shape[0]}, Q]")
    Q = trail.shape[1]
    q_lens = cu[1 : n + 1] - cu[:n]
    for s in np.flatnonzero(q_lens > Q):
        raise ValueError(f"state_trail: sequence {s} feeds {q_lens[s]} tokens, more than Q={Q}")
    named = trail[:n][np.arange(Q)[None, :] < q_lens[:, None]]
    named = named[named >= 0]
    if num_slots is not None and (named >= num_slots).any():
        raise ValueError(f"state_trail names slot {named.max()}, past the pool's {num_slots} slots")
    values, counts = np.unique(named, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"state_trail names slot {values[counts > 1][0]} more than once")
    shared = np.intersect1d(named, slots[:n][slots[:n] >= 0])
    if shared.size:
        raise ValueError(f"state_trail names working slot {shared[0]} of this step")
