"""Multi-token-prediction drafts, inside the step program (``--speculative_algorithm
NEXTN``): after the main model's forward and the sampling, the model's first MTP block
(``models/layers/mtp_nextn.py``) runs over the step's token rows and then chains, one token
per sequence at a time, so each sequence's next draft leaves the device with its sampled
tokens and the next step can verify it without a host round trip in between.

The block at position ``p`` reads the main model's final-norm output there and the token at
``p + 1``, writes its own KV at ``p`` (its cache entry is the one after the main layers',
``ModelConfig.cache_layer_kinds``, paged alike, so the tree, L2 and L3 carry it as they
carry a main layer's), and predicts the token at ``p + 2``. Over a step's rows:

- the token after a row is the prompt's next token where the row is inside a prompt
  (``DraftInputs.next_ids``), else the token sampled at the row (a decode row, a prompt's
  last row, a verify row: after an accepted draft token the sampled token *is* the next
  draft token, and rows past the accepted ones lie past the sequence's length, to be
  written again before anything reads them);
- the first draft is predicted at the sequence's last accepted row: ``draft_rows`` plus
  the leading draft tokens that equal the tokens sampled before them, counted here as the
  engine counts them (``Engine._results``);
- draft ``i + 1`` feeds draft ``i`` at the next position with the block's own output as its
  hidden state (the peers' chaining), writing the block's KV there. Those positions are the
  next step's first rows, so the next step writes them again with the verified tokens; a
  chained position without a page (``draft_caps``) ends the sequence's draft (-1).

A page's last position holds the block's KV for the token after the page, which another
request sharing the page may not have: a draft read through a shared prefix can differ
from one computed alone. Drafts only decide how many tokens a step yields; outputs are the
verify step's (``scheduler/drafts.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.cache import paged_specs
from hicache_jax.models.page_loads import land
from hicache_jax.runtime.step_inputs import DraftInputs


def accepted_rows(ids: jax.Array, nxt: jax.Array, d: DraftInputs, steps: int) -> jax.Array:
    """[S] per sequence its last accepted row: ``draft_rows`` plus the leading draft tokens
    (fed at rows ``draft_rows + 1 + j``) equal to the token after the row before them."""
    T = ids.shape[0]
    j = jnp.arange(steps, dtype=jnp.int32)
    at = jnp.clip(d.draft_rows[:, None] + j[None, :], 0, T - 1)
    fed = ids[jnp.minimum(at + 1, T - 1)]
    match = (nxt[at] == fed) & (j[None, :] < d.draft_lens[:, None])
    return jnp.minimum(d.draft_rows + jnp.sum(jnp.cumprod(match, axis=1), axis=1), T - 1).astype(jnp.int32)


def chain_batch(batch: ForwardBatch, ids: jax.Array, q: jax.Array, ok: jax.Array, page_size: int):
    """One token per sequence: ``ids`` at positions ``q``; the KV written where ``ok``."""
    S = q.shape[0]
    live = jnp.arange(S) < batch.num_seqs
    rows = jnp.arange(S)

    def slot(table):
        page = table[rows, jnp.clip(q // page_size, 0, table.shape[1] - 1)]
        return jnp.where(ok, page * page_size + q % page_size, -1).astype(jnp.int32)

    return ForwardBatch(
        input_ids=ids,
        positions=q,
        cu_q_lens=jnp.minimum(jnp.arange(S + 1), batch.num_seqs).astype(jnp.int32),
        kv_lens=jnp.where(live, q + 1, 0).astype(jnp.int32),
        num_seqs=batch.num_seqs,
        page_tables=batch.page_tables,
        slot_mappings={g: slot(t) for g, t in batch.page_tables.items()},
        state_slots=jnp.full((S,), -1, jnp.int32),
        has_initial_state=jnp.zeros((S,), bool),
        logits_indices=rows.astype(jnp.int32),
        decode_only=True,
    )


def mtp_drafts(
    model, cache: tuple, hidden: jax.Array, batch: ForwardBatch, sampled, d: DraftInputs, steps: int
):
    """The step's drafts (module docstring): ``hidden [T, h]`` the main model's final-norm
    output, ``sampled [N]`` the step's sampled ids. Returns the cache (the block's entry
    written) and ``[S, steps]`` int32 drafts, -1 past a sequence's pages."""
    L = len(model.layers)
    block = model.mtp[0]
    entry = cache[L]
    page_size = jax.tree_util.tree_leaves(entry)[0].shape[1]
    nxt = jnp.where(d.next_rows >= 0, sampled[jnp.maximum(d.next_rows, 0)], d.next_ids)
    rows = accepted_rows(batch.input_ids, nxt, d, steps)
    if batch.loads is not None and batch.loads.pages[L] is not None:  # its L2 pages, layer by layer
        entry, hidden = land(entry, hidden, batch.loads, L, paged_specs(model.cfg, block.kind))
    over = dataclasses.replace(
        batch, input_ids=nxt, logits_indices=rows, feed_rows=None, loads=None, state_trail=None
    )
    entry, h, logits = block(entry, hidden, over, model.embed, model.unembed)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out, h, p = [tok], h[rows], batch.positions[rows]
    for i in range(1, steps):
        q = p + i
        ok = (jnp.arange(q.shape[0]) < batch.num_seqs) & (q < d.draft_caps)
        entry, h, logits = block(
            entry, h, chain_batch(batch, tok, q, ok, page_size), model.embed, model.unembed
        )
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(jnp.where(ok, tok, -1))
    return cache[:L] + (entry,) + tuple(cache[L + 1 :]), jnp.stack(out, axis=1)
