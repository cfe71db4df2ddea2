"""What one forward step reads besides the weights and the cache.

A step runs a *ragged* batch: the new tokens of ``num_seqs`` sequences laid end to end,
prefill chunks and single decode tokens alike::

    tokens     | seq 0 (prefill chunk) | seq 1 | seq 2 (chunk) | pad ... |
    cu_q_lens  0                       5       6               9         (then repeats 9)

Sequence ``s`` owns tokens ``cu_q_lens[s] : cu_q_lens[s+1]`` and, after the step, has
``kv_lens[s]`` tokens in the cache (the new ones included), so its first new token sits at
position ``kv_lens[s] - q_len[s]``.

Attention KV lives in pages. Each page group (``"full"`` for full-attention layers,
``"swa"`` for sliding-window layers) has its own page table, so the engine may release
sliding-window pages that fell out of the window while full-attention pages stay.
``slot_mappings[group][t]`` is where token ``t``'s K/V goes (``page * page_size + offset``;
-1 writes nothing). Mamba layers read and write per-sequence state slots.

Arrays have static shapes (padded to buckets by the engine); padding sequences have
``q_len = kv_len = 0`` and slot -1, padding tokens lie past ``cu_q_lens[num_seqs]``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

PAGE_GROUPS = ("full", "swa")


def page_group(kind: str) -> str:
    """The page group a layer kind's KV lives in."""
    return "swa" if kind == "sliding" else "full"


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    kv_lens: jax.Array  # [S] int32
    num_seqs: jax.Array  # [] int32
    page_tables: dict  # group -> [S, max_pages] int32
    slot_mappings: dict  # group -> [T] int32
    state_slots: jax.Array  # [S] int32, Mamba state slot per sequence (-1: none)
    has_initial_state: jax.Array  # [S] bool: read the slot's state (else start from zero)
    logits_indices: jax.Array  # [R] int32: token rows whose logits the step returns
    # [T] int32 or None: -1 where ``input_ids`` holds the token, else the row of the previous
    # step's sampled ids to feed (the overlap schedule; the runner resolves it on device).
    feed_rows: jax.Array | None = None
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
    ],
    meta_fields=["decode_only"],
)


def build_batch(
    seqs: list[tuple[list[int] | np.ndarray, int, np.ndarray]],
    *,
    groups: tuple[str, ...],
    page_size: int,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_pages: int | None = None,
    logits: str = "last",
    num_logits: int | None = None,
    state_slots: list[int] | None = None,
    has_initial_state: list[bool] | None = None,
) -> ForwardBatch:
    """Build a host-side ForwardBatch.

    ``seqs``: per sequence ``(new_token_ids, num_cached_tokens, page_table)``; the page
    table (one per sequence, shared by every group here) must cover
    ``num_cached + len(new)`` tokens. ``logits="last"`` returns logits of each sequence's
    last new token, ``"all"`` of every new token. Shapes pad to ``num_tokens`` /
    ``num_seqs`` / ``max_pages`` when given.
    """
    q_lens = [len(s[0]) for s in seqs]
    total = sum(q_lens)
    T = num_tokens or total
    S = num_seqs or len(seqs)
    P = max_pages or max(len(s[2]) for s in seqs)
    if T < total or S < len(seqs):
        raise ValueError(f"batch of {len(seqs)} seqs / {total} tokens exceeds padding {S}/{T}")
    ids = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    slots = np.full(T, -1, np.int32)
    cu = np.zeros(S + 1, np.int32)
    kv = np.zeros(S, np.int32)
    table = np.zeros((S, P), np.int32)
    rows: list[int] = []
    t = 0
    for i, (new, cached, pages) in enumerate(seqs):
        n = len(new)
        pages = np.asarray(pages, np.int32)
        if cached + n > len(pages) * page_size:
            raise ValueError(f"seq {i}: {cached + n} tokens do not fit {len(pages)} pages")
        ids[t : t + n] = np.asarray(new, np.int32)
        p = np.arange(cached, cached + n)
        pos[t : t + n] = p
        slots[t : t + n] = pages[p // page_size] * page_size + p % page_size
        table[i, : len(pages)] = pages
        kv[i] = cached + n
        rows.extend(range(t, t + n) if logits == "all" else [t + n - 1])
        t += n
        cu[i + 1] = t
    cu[len(seqs) + 1 :] = t
    R = num_logits or len(rows)
    logit_rows = np.zeros(R, np.int32)
    logit_rows[: len(rows)] = rows
    st = np.full(S, -1, np.int32)
    hi = np.zeros(S, bool)
    if state_slots is not None:
        st[: len(seqs)] = state_slots
        hi[: len(seqs)] = has_initial_state
    return ForwardBatch(
        input_ids=ids,
        positions=pos,
        cu_q_lens=cu,
        kv_lens=kv,
        num_seqs=np.int32(len(seqs)),
        page_tables={g: table for g in groups},
        slot_mappings={g: slots for g in groups},
        state_slots=st,
        has_initial_state=hi,
        logits_indices=logit_rows,
        decode_only=all(q == 1 for q in q_lens),
    )
