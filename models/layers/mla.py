"""Multi-head latent attention (DeepSeek V3) and DeepSeek Sparse Attention (V3.2, GLM-5).

Per token the cache keeps one row every head shares (``LatentPages``, ``models/cache.py``)::

    row      | c: kv_a_layernorm(latent)  (kv_lora_rank) | k_rope (qk_rope_head_dim) |

Keys and values per head would be ``c @ kv_b_proj`` (``W_UK``: ``qk_nope_head_dim`` per head,
``W_UV``: ``v_head_dim``). Attention runs in the absorbed form for prefill and decode alike:
the query's no-rope part is multiplied by ``W_UK`` into latent space (``q_lat``), scores are
``q_lat . c + q_rope . k_rope``, the output is a weighted sum of ``c`` and goes through
``W_UV`` after, so nothing is ever expanded per head.

A ``dsa`` layer also runs the lightning indexer: its own query heads (from the same
``q_lora_rank`` bottleneck) and one key per token (``IndexPages``), scored
``sum_h w_h relu(q_h . k)``; each query attends to its ``index_topk`` best positions among
those it can see (causal: a position after the query is never picked, unlike transformers'
full forward, which ranks them too). A ``dsa_shared`` layer reuses the previous ``dsa``
layer's picks and keeps no indexer keys. When ``index_topk`` covers every position a step
can see, the picks are every visible position and the layer attends densely.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hicache_jax.kinds import CacheKind, LayerKind
from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.cache import IndexPages, LatentPages, join, paged_specs, parts
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels import backend, sharded
from hicache_jax.models.kv_quant import field_scales, rescale, store, unscale
from hicache_jax.models.layers.attention import q_block
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.norms import LayerNorm, RMSNorm
from hicache_jax.models.layers.rope import apply_rope, rope_frequencies

# Positions the indexer scores at a time (``Indexer.picks``).
INDEX_BLOCK = 2048

# The low-rank query's and the latent's norms keep transformers' default epsilon whatever
# the config's ``rms_norm_eps`` (DeepSeek V3 and GLM-5 build them without it).
LATENT_NORM_EPS = 1e-6


def deinterleave(x: jax.Array, rot: int) -> jax.Array:
    """Channel pairs (0, 1), (2, 3) ... of the first ``rot`` channels laid out as halves
    (evens, then odds), so "rotate half" rope rotates each pair (DeepSeek's layout)."""
    order = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, x.shape[-1])])
    return x[..., order]


def write_rows(pages: jax.Array, rows: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """``rows [T, D]`` into ``pages [num_pages, page_size, D]`` at slots ``page * page_size +
    offset`` (-1: not written)."""
    n, P = pages.shape[:2]
    flat = pages.reshape(n * P, *pages.shape[2:])
    slots = jnp.where(slot_mapping < 0, n * P, slot_mapping)  # past the pool: dropped
    return flat.at[slots].set(store(rows, pages.dtype), mode="drop").reshape(pages.shape)


def attend_picked(q: jax.Array, pages: jax.Array, table: jax.Array, batch: ForwardBatch, picks, scale: float):
    """Each token's attention over the latent rows it picked (``picks [T, K]`` positions of
    its sequence, -1: none): ``q [T, H, L + R]`` against rows ``[T, K, L + R]``, values the
    rows themselves; ``[T, H, L + R]`` float32 (the caller keeps the first L)."""
    T, P = q.shape[0], pages.shape[1]
    seq = _token_seqs(batch, table.shape[0])
    pos = jnp.maximum(picks, 0)
    page = jnp.take_along_axis(table[seq], pos // P, axis=1)  # [T, K]
    rows = pages.reshape(-1, pages.shape[-1])[page * P + pos % P].astype(jnp.float32)  # [T, K, D]
    live = (picks >= 0) & (jnp.arange(T) < batch.cu_q_lens[batch.num_seqs])[:, None]
    rows = jnp.where(live[..., None], rows, 0.0)  # unused slots may hold anything (NaN)
    s = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), rows) * scale
    s = jnp.where(live[:, None], s, -jnp.inf)
    p = jnp.where(live[:, None], jax.nn.softmax(s, axis=-1), 0.0)  # a padding token: all zero
    return jnp.einsum("thk,tkd->thd", p, rows)


def _token_seqs(batch: ForwardBatch, num_seqs: int) -> jax.Array:
    """``[T]``: each token's sequence (padding tokens: a valid index, their rows unused)."""
    T = batch.input_ids.shape[0]
    seq = jnp.searchsorted(batch.cu_q_lens, jnp.arange(T, dtype=jnp.int32), side="right") - 1
    return jnp.clip(seq, 0, num_seqs - 1)


class Indexer(nnx.Module):
    """The lightning indexer of DeepSeek Sparse Attention (transformers' names)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        m = cfg.mla
        self.n_heads, self.head_dim, self.rot = m.index_n_heads, m.index_head_dim, m.qk_rope_head_dim
        self.topk, self.interleave = m.index_topk, m.index_rope_interleave
        self.wq_b = Linear(
            m.q_lora_rank, m.index_n_heads * m.index_head_dim, bias=False, dtype=dtype, rngs=rngs
        )
        self.wk = Linear(cfg.hidden_size, m.index_head_dim, bias=False, dtype=dtype, rngs=rngs)
        self.k_norm = LayerNorm(m.index_head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, m.index_n_heads, bias=False, dtype=dtype, rngs=rngs)

    def _rope(self, x: jax.Array, positions: jax.Array, rope: dict) -> jax.Array:
        if self.interleave:
            x = deinterleave(x, self.rot)
        return apply_rope(x, positions, **rope)

    def keys(self, x: jax.Array, positions: jax.Array, rope: dict) -> jax.Array:
        """``[T, index_head_dim]``: each token's key, as the cache keeps it."""
        return self._rope(self.k_norm(self.wk(x))[:, None, :], positions, rope)[:, 0]

    def picks(
        self,
        x,
        q_resid,
        keys: IndexPages,
        batch: ForwardBatch,
        rope: dict,
        max_kv: int,
        kernels=None,
        key_scale: float = 1.0,
    ) -> jax.Array:
        """``[T, K]`` int32: the positions each token attends to (-1: none). ``key_scale``:
        the stored keys' (``kv_quant.py``); ``relu`` is positively homogeneous, so it scales
        each head's weight."""
        T = x.shape[0]
        q = self._rope(self.wq_b(q_resid).reshape(T, self.n_heads, self.head_dim), batch.positions, rope)
        w = self.weights_proj(x).astype(jnp.float32) * self.n_heads**-0.5  # [T, heads]
        w = rescale(w, key_scale)
        table = batch.page_tables[CacheKind.INDEX]
        return top_k_rows(q, w, keys.k, table, batch, batch.positions, min(self.topk, max_kv), kernels)


def top_k_rows(q, w, keys, table, batch: ForwardBatch, last, K: int, kernels=None) -> jax.Array:
    """A lightning indexer's choice: ``[T, K]`` int32, the rows of its sequence each token
    attends to (-1: none), ranked by ``sum_h w_h relu(q_h . k / sqrt(d))`` among rows
    ``0 .. last[t]``. ``keys [pages, rows, d]``: one key per row (per token for DSA, per
    compressed entry for DeepSeek V4), ``table``: each sequence's pages. The keys are scored
    ``INDEX_BLOCK`` rows at a time, merged into a running top-k, up to the last row any
    token of the step sees: memory follows the block, not the context. ``kernels`` with the
    ``pallas`` attention backend: the Pallas kernel (``kernels/index_scores``) writes every
    score ``[T, N]`` from the pool in place and ``lax.top_k`` picks (ties: the lower row,
    as here)."""
    T, d = q.shape[0], q.shape[-1]
    q = q.astype(jnp.float32) * d**-0.5
    live = jnp.arange(T) < batch.cu_q_lens[batch.num_seqs]
    scores_fn = kernels and backend.index_scores_fn(kernels.attention_backend, kernels.interpret)
    if scores_fn is not None:
        score = sharded.replicated(scores_fn, kernels.mesh, 6)
        seq = _token_seqs(batch, table.shape[0])
        scores = score(q, w, keys, table, seq, jnp.where(live, last, -1).astype(jnp.int32))
        best, idx = jax.lax.top_k(scores, K)
        return jnp.where(best > -jnp.inf, idx, -1).astype(jnp.int32)
    P = keys.shape[1]
    bp = min(table.shape[1], max(1, INDEX_BLOCK // P))  # pages per block
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % bp)))  # whole blocks (past kv: unseen)
    width = bp * P
    seq = _token_seqs(batch, table.shape[0])

    def block(b, carry):
        best, idx = carry
        pages = jax.lax.dynamic_slice_in_dim(table, b * bp, bp, axis=1)[seq]  # [T, bp]
        rows = keys[pages].reshape(T, width, -1).astype(jnp.float32)
        pos = b * width + jnp.arange(width, dtype=jnp.int32)
        seen = (pos[None, :] <= last[:, None]) & live[:, None]
        rows = jnp.where(seen[..., None], rows, 0.0)  # unused pages may hold anything (NaN)
        scores = jax.nn.relu(jnp.einsum("thd,tkd->thk", q, rows))
        total = jnp.where(seen, jnp.einsum("th,thk->tk", w, scores), -jnp.inf)
        merged = jnp.concatenate([best, total], axis=1)
        at = jnp.concatenate([idx, jnp.broadcast_to(pos, (T, width))], axis=1)
        best, order = jax.lax.top_k(merged, K)
        return best, jnp.take_along_axis(at, order, axis=1)

    sees = jnp.max(jnp.where(live, last, -1)) + 1  # rows some token sees
    init = (jnp.full((T, K), -jnp.inf, jnp.float32), jnp.full((T, K), -1, jnp.int32))
    best, idx = jax.lax.fori_loop(0, (sees + width - 1) // width, block, init)
    return jnp.where(best > -jnp.inf, idx, -1)


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, kind: str, *, dtype, rngs: nnx.Rngs, kernels):
        m, h, H = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.kind = LayerKind(kind)
        self.specs = paged_specs(cfg, kind)
        self.num_heads, self.nope, self.rot, self.v_dim = (
            H,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        )
        self.rank, self.interleave, self.scale = m.kv_lora_rank, m.rope_interleave, m.softmax_scale
        inv_freq, rope_scale = rope_frequencies(cfg.rope_theta, m.qk_rope_head_dim, 1.0, cfg.rope_yarn)
        self.inv_freq, self.rope_scale = tuple(inv_freq.tolist()), rope_scale  # static: hashable
        self.kernels = kernels
        if m.q_lora_rank:
            self.q_a_proj = Linear(h, m.q_lora_rank, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False, dtype=dtype, rngs=rngs)
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = Linear(h, H * m.qk_head_dim, bias=False, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(h, m.latent_dim, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
        # kv_b_proj's two halves, head-major (batched matmuls read them without a transpose):
        # W_UK [H, qk_nope_head_dim, L] takes a query into latent space, W_UV [H, L, v_head_dim]
        # takes the attended latent out (``models/hf/weights.py`` splits the checkpoint's).
        scale = m.kv_lora_rank**-0.5
        self.w_uk = nnx.Param(
            (jax.random.normal(rngs.params(), (H, m.qk_nope_head_dim, m.kv_lora_rank)) * scale).astype(dtype)
        )
        self.w_uv = nnx.Param(
            (jax.random.normal(rngs.params(), (H, m.kv_lora_rank, m.v_head_dim)) * scale).astype(dtype)
        )
        self.o_proj = Linear(H * m.v_head_dim, h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs) if self.kind == LayerKind.DSA else None
        # Per-tensor scales of the pages (``kv_quant.py``): ((latent,), (index keys,)) or
        # ((latent,),); None: 1.0. Static, set once the model is built.
        self.kv_scales = None

    @property
    def rope(self) -> dict:
        return dict(inv_freq=self.inv_freq, scale=self.rope_scale)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        if self.interleave:
            x = deinterleave(x, self.rot)
        return apply_rope(x, positions, **self.rope)

    @jax.named_scope("mla")
    def __call__(self, entry, x: jax.Array, batch: ForwardBatch, picks: jax.Array | None = None):
        """Returns the new cache entry, the output and the positions attended (``picks``,
        for a following ``dsa_shared`` layer; None when attending densely)."""
        T, H = x.shape[0], self.num_heads
        if self.q_proj is None:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        else:
            q_resid, q = None, self.q_proj(x)
        q = q.reshape(T, H, self.nope + self.rot)
        q_nope, q_rope = q[..., : self.nope], self._rope(q[..., self.nope :], batch.positions)
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[:, : self.rank])
        k_rope = self._rope(kv[:, None, self.rank :], batch.positions)[:, 0]
        pages = dict(zip((s.kind for s in self.specs), parts(entry, self.specs)))
        row = jnp.concatenate([c, k_rope], axis=-1)
        # One scale for the whole row, a key and a value alike: it folds into the softmax
        # scale and multiplies the output.
        (s,) = field_scales(self.kv_scales, 0, 1)
        latent = LatentPages(
            write_rows(pages[CacheKind.LATENT].c, unscale(row, s), batch.slot_mappings[CacheKind.LATENT])
        )
        new = [latent]
        max_kv = batch.page_tables[CacheKind.LATENT].shape[1] * latent.c.shape[1]
        if self.indexer is not None:
            (ks,) = field_scales(self.kv_scales, 1, 1)
            keys = unscale(self.indexer.keys(x, batch.positions, self.rope), ks)
            keys = IndexPages(
                write_rows(pages[CacheKind.INDEX].k, keys, batch.slot_mappings[CacheKind.INDEX])
            )
            new.append(keys)
            picks = None
            if self.indexer.topk < max_kv:  # else every visible position is picked: dense
                picks = self.indexer.picks(
                    x, q_resid, keys, batch, self.rope, max_kv, self.kernels, key_scale=ks
                )
        q_lat = jnp.einsum("thn,hnl->thl", q_nope, self.w_uk[...])
        # One KV "head" every query head shares: keys are whole rows (latent, rope key),
        # values the rows too, of which the output keeps the latent part.
        q = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)
        table = batch.page_tables[CacheKind.LATENT]
        if picks is None:
            name = self.kernels.attention_backend
            fn = backend.attention_fn(name, self.kernels.interpret)
            block = q_block(name, batch, T)
            attend = sharded.latent_attention(fn, self.kernels.mesh, sm_scale=self.scale * s, q_block=block)
            rows = latent.c[:, :, None, :]  # [pages, page_size, 1, L + R]: a bitcast of the pool
            o = attend(q, rows, rows, batch.kv_lens, table, batch.cu_q_lens, batch.num_seqs)
        elif self.kernels.attention_backend == "pallas":  # the picked rows by DMA, per token
            fn = backend.row_attention_fn("pallas", self.kernels.interpret)
            attend = sharded.row_attention(fn, self.kernels.mesh, sm_scale=self.scale * s)
            live = (jnp.arange(T) < batch.cu_q_lens[batch.num_seqs])[:, None]
            seq = _token_seqs(batch, table.shape[0])
            o, _ = attend(q, latent.c, table, seq, jnp.where(live, picks, -1))
        else:
            o = attend_picked(q, latent.c, table, batch, picks, self.scale * s)
        o = rescale(o[..., : self.rank], s)
        o = jnp.einsum("thl,hlv->thv", o.astype(x.dtype), self.w_uv[...])
        return join(new, self.specs), self.o_proj(o.reshape(T, H * self.v_dim)), picks
