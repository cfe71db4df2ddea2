"""Plain-JAX MLA attention over latent pages (temporary, lead's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def latent_write(pages, rows, slot_mapping):
    n, P = pages.shape[:2]
    flat = pages.reshape(n * P, *pages.shape[2:])
    idx = jnp.where(slot_mapping < 0, n * P, slot_mapping)
    return flat.at[idx].set(rows.astype(pages.dtype), mode="drop").reshape(pages.shape)


def mla_attention_reference(
    q_lat, q_rope, pages, kv_lens, page_tables, cu_q_lens, num_seqs, *, sm_scale, topk=None
):
    T, H, L = q_lat.shape
    P = pages.shape[1]
    max_kv = page_tables.shape[1] * P
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, jnp.arange(T), side="right") - 1, 0, page_tables.shape[0] - 1)
    rows = pages[page_tables[seq]].reshape(T, max_kv, -1).astype(jnp.float32)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (jnp.arange(T) - cu_q_lens[seq])
    live = jnp.arange(T) < cu_q_lens[num_seqs]
    mask = (jnp.arange(max_kv)[None] <= pos[:, None]) & live[:, None]
    if topk is not None:
        sel = (
            jnp.zeros((T, max_kv + 1), bool)
            .at[jnp.arange(T)[:, None], jnp.where(topk < 0, max_kv, topk)]
            .set(True)
        )
        mask = mask & sel[:, :max_kv]
    rows = jnp.where(mask[..., None], rows, 0.0)  # unused pages may hold anything (NaN)
    s = jnp.einsum("thl,tkl->thk", q_lat.astype(jnp.float32), rows[..., :L])
    s = s + jnp.einsum("thr,tkr->thk", q_rope.astype(jnp.float32), rows[..., L:])
    s = jnp.where(mask[:, None], s * sm_scale, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None], p, 0.0)
    return jnp.einsum("thk,tkl->thl", p, rows[..., :L])
