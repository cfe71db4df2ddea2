"""DeepSeek V4's attention: one K=V head over a sliding window, plus compressed entries.

Every layer keeps the last ``sliding_window`` tokens' rows (``SharedKVPages`` in the ``swa``
cache; keys and values are the same rows). A ``csa`` or ``hca`` layer also compresses its
prefix, ``rate`` tokens into one entry, and attends over those too::

    tokens    | w0: 0..r-1 | w1: r..2r-1 | w2 ...      entry w, visible once window w is complete
    hca       entry w = sum over window w of softmax(gate + bias) * kv      (per channel)
    csa       entry w = sum over the "Ca" half of window w-1 and the "Cb" half of window w
              (two series of each token's projections), of softmax(gate + bias) * kv

then normed and rotated at position ``w * r``. A ``csa`` layer's lightning indexer keeps its
own compressed keys (same windows, ``index_head_dim``) and picks each query's top
``index_topk`` entries; an ``hca`` layer attends to every visible entry. Attention is one
softmax over the window's rows, the chosen entries and a learned sink per head; the output's
rotated channels are rotated back by the query's position, and the heads go out through a
grouped low-rank projection.

**The compressor's state.** A softmax over a window is kept as a running pair per channel,
``(lse, mean)``: the log-sum-exp of the gates seen so far and the softmax-weighted mean of
their values, which two parts of a window combine into exactly (``merge``). So a window may
span steps (decode, chunked prefill) and pages: after each step, every page a sequence wrote
gets its compressor's state after its last token there (``CompressorState``: one row per page,
float32), and the next step (or a prefix that ends at that page) starts from it. Pages hold
whole entries (``page_size`` a multiple of ``rate``), so at a page's end an ``hca`` window is
always complete (its state is empty) and a ``csa`` state holds the window whose "Ca" half
the next entry needs. Within a step the pairs combine by a segmented associative scan over
the step's tokens (a segment per window), so prefill does not loop over tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hicache_jax.kinds import CacheKind, LayerKind
from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.cache import CompressorState, IndexPages, SharedKVPages, join, paged_specs, parts
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels import backend, sharded
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.kernels.paged_row_attention.reference import merge as merge_sources
from hicache_jax.models.kv_quant import dequantize, field_scales, rescale, unscale
from hicache_jax.models.layers.attention import PREFILL_Q_BLOCK
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.mla import _token_seqs, top_k_rows, write_rows
from hicache_jax.models.layers.norms import RMSNorm, rms_normalize
from hicache_jax.models.layers.rope import rope_frequencies
from hicache_jax.models.sharding import AXIS, constrain

NEG_INF = -jnp.inf
# Queries are attended a block at a time (``query_blocks``): at most QUERY_BLOCK tokens, and
# fewer (a multiple of 8) where each reads many rows, so a block gathers at most BLOCK_ROWS
# rows (an ``hca`` layer reads every entry the page table could hold: 8,192 of 512 channels
# at a 1M context and page size 128, 8 MiB a token in bfloat16; unblocked, a 512-token
# prefill chunk of V4 Flash at tp 8 needed 4.5 GiB of temporaries per chip, 0.6 in blocks).
QUERY_BLOCK = 256
BLOCK_ROWS = 1 << 19


def rope_tail(x: jax.Array, positions: jax.Array, inv_freq, scale: float = 1.0) -> jax.Array:
    """Rotate the last ``2 * len(inv_freq)`` channels of ``x [T, ..., D]`` by ``positions [T]``,
    channel pairs (0, 1), (2, 3) ... of that tail (DeepSeek V4's layout), in float32."""
    inv_freq = np.asarray(inv_freq, np.float32)
    half = inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, half]
    shape = (angles.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = (jnp.cos(angles) * scale).reshape(shape), (jnp.sin(angles) * scale).reshape(shape)
    head, tail = x[..., : -2 * half], x[..., -2 * half :].astype(jnp.float32)
    a, b = tail[..., 0::2], tail[..., 1::2]
    rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rotated.astype(x.dtype)], axis=-1)


def merge(a, b):
    """Two parts of one softmax-weighted mean, ``(lse, mean)`` each, as one (an empty part:
    ``lse = -inf``, ``mean = 0``)."""
    la, ma = a
    lb, mb = b
    lse = jnp.logaddexp(la, lb)
    wa = jnp.where(la == NEG_INF, 0.0, jnp.exp(la - lse))
    wb = jnp.where(lb == NEG_INF, 0.0, jnp.exp(lb - lse))
    return lse, ma * wa + mb * wb


def segment_scan(reset: jax.Array, lse: jax.Array, mean: jax.Array):
    """Running ``merge`` along the tokens ``[T, C]``, restarting where ``reset [T]``."""

    def op(x, y):
        rx, lx, mx = x
        ry, ly, my = y
        lse, mean = merge((lx, mx), (ly, my))
        r = ry[:, None]
        return rx | ry, jnp.where(r, ly, lse), jnp.where(r, my, mean)

    _, lse, mean = jax.lax.associative_scan(op, (reset, lse, mean))
    return lse, mean


def empty_state(shape) -> tuple[jax.Array, jax.Array]:
    return jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32)


class Steps:
    """Where each token of a ragged step sits: its sequence, whether it starts the sequence's
    new tokens or ends them, and its page of ``page_size`` tokens."""

    def __init__(self, batch: ForwardBatch, num_seqs: int, page_size: int):
        T = batch.input_ids.shape[0]
        t = jnp.arange(T, dtype=jnp.int32)
        self.seq = _token_seqs(batch, num_seqs)
        self.live = t < batch.cu_q_lens[batch.num_seqs]
        self.first = t == batch.cu_q_lens[self.seq]
        self.last = t == batch.cu_q_lens[self.seq + 1] - 1
        q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
        self.start = batch.kv_lens - q_lens  # [S]: each sequence's first new position
        self.page_size = page_size
        self.verify = batch.state_trail is not None  # a verify step (speculative decoding)

    def prior(self, pages: CompressorState, table: jax.Array):
        """Each sequence's compressor state before its first new token, ``[S, W, C]`` twice:
        the state row of the page holding the token before (empty at position 0)."""
        P = self.page_size
        S = table.shape[0]
        page = table[jnp.arange(S), jnp.maximum(self.start - 1, 0) // P]
        has = (self.start > 0)[:, None, None]
        lse0, mean0 = empty_state(pages.lse.shape[2:])
        lse = jnp.where(has, pages.lse[page, 0], lse0)  # never-written rows may hold NaN
        mean = jnp.where(has, pages.mean[page, 0], mean0)
        return lse, mean

    def write_state(self, pages: CompressorState, lse, mean, positions, slot_mapping) -> CompressorState:
        """Each sequence's state after its last token in each page it wrote (``[T, W, C]``
        per token: the state after that token). A verify step writes every token's: a draft
        stays inside one page, and the state after each fed token but the last goes to a
        scratch page (``slot_mapping``), the one that replaces the page's if the token is
        the last one accepted (``CacheAdapter.after_verify``)."""
        P = self.page_size
        ends = self.last | (positions % P == P - 1) | self.verify
        ends = ends & self.live & (slot_mapping >= 0)
        row = jnp.where(ends, slot_mapping // P, -1)
        return CompressorState(write_rows(pages.lse, lse, row), write_rows(pages.mean, mean, row))


class Compressor(nnx.Module):
    """One compressed series of entries of ``dim`` channels (transformers' compressor, or its
    indexer's): per token ``kv`` and ``gate`` projections (two series, "Ca" then "Cb", when
    windows overlap), a learned bias per position in the window, the norm of each entry."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, *, eps: float, dtype, rngs: nnx.Rngs):
        n = 2 if overlap else 1
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = Linear(hidden, n * dim, bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(hidden, n * dim, bias=False, dtype=dtype, rngs=rngs)
        self.position_bias = nnx.Param(jnp.zeros((rate, n * dim), jnp.float32))
        self.kv_norm = RMSNorm(dim, eps=eps, dtype=dtype)

    def series(self, x: jax.Array, positions: jax.Array):
        """Per token ``(gate, kv)`` float32 ``[T, n * dim]``, the bias of its place added."""
        gate = self.gate_proj(x).astype(jnp.float32) + self.position_bias[...][positions % self.rate]
        return gate, self.kv_proj(x).astype(jnp.float32)


def compress(comps: list[Compressor], x, positions, steps: Steps, prior):
    """The step's compressed entries and states for compressors over the same windows
    (their channels side by side). ``prior``: ``[S, W, C]`` (lse, mean), W = 2 windows for
    overlapping compressors (the entry being built, then the next one's "Ca" half), else 1.

    Returns per token the entry its window ends with (``[T, C]`` float32, meaningful where
    ``positions % rate == rate - 1``) and the state after it (``[T, W, C]`` twice)."""
    rate, overlap = comps[0].rate, comps[0].overlap
    halves = [c.series(x, positions) for c in comps]
    starts = (positions % rate == 0) | steps.first
    ends = positions % rate == rate - 1
    p_lse, p_mean = prior[0][steps.seq], prior[1][steps.seq]  # [T, W, C]
    first = steps.first[:, None]

    def side(k):  # the series' k-th half, every compressor's channels side by side
        gate = jnp.concatenate([g[:, k * c.dim : (k + 1) * c.dim] for (g, _), c in zip(halves, comps)], -1)
        kv = jnp.concatenate([v[:, k * c.dim : (k + 1) * c.dim] for (_, v), c in zip(halves, comps)], -1)
        return gate, kv

    def seeded(elem, seed, where):
        lse, mean = merge(seed, elem)
        return jnp.where(where, lse, elem[0]), jnp.where(where, mean, elem[1])

    if not overlap:
        elem = seeded(side(0), (p_lse[:, 0], p_mean[:, 0]), first)
        lse, mean = segment_scan(starts, *elem)
        e_lse, e_mean = empty_state(lse.shape)
        state = (
            jnp.where(ends[:, None], e_lse, lse)[:, None],
            jnp.where(ends[:, None], e_mean, mean)[:, None],
        )
        return mean, state
    # "Ca" halves of the current window: they open the next entry.
    b_lse, b_mean = segment_scan(starts, *seeded(side(0), (p_lse[:, 1], p_mean[:, 1]), first))
    # "Cb" halves close the current entry, which opens with the previous window's "Ca":
    # the stored one on a step's first token, else the scan's value just before the window.
    prev = (jnp.roll(b_lse, 1, axis=0), jnp.roll(b_mean, 1, axis=0))
    seed = tuple(jnp.where(first, p[:, 0], q) for p, q in zip((p_lse, p_mean), prev))
    a_lse, a_mean = segment_scan(starts, *seeded(side(1), seed, starts[:, None]))
    e_lse, e_mean = empty_state(b_lse.shape)
    end = ends[:, None]
    state_a = (jnp.where(end, b_lse, a_lse), jnp.where(end, b_mean, a_mean))
    state_b = (jnp.where(end, e_lse, b_lse), jnp.where(end, e_mean, b_mean))
    state = tuple(jnp.stack([a, b], axis=1) for a, b in zip(state_a, state_b))
    return a_mean, state


def attend_rows(q, rows, valid, sinks, scale: float):
    """``q [T, H, D]`` over ``rows [T, N, D]`` (keys and values alike) where ``valid [T, N]``,
    with a sink logit per head in the softmax; float32 ``[T, H, D]``."""
    rows = jnp.where(valid[..., None], rows.astype(jnp.float32), 0.0)  # unused rows may be NaN
    s = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), rows) * scale
    s = jnp.where(valid[:, None], s, NEG_INF)
    sink = sinks.astype(jnp.float32)[None, :, None]
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
    e = jnp.where(valid[:, None], jnp.exp(s - m), 0.0)
    p = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))
    return jnp.einsum("thn,tnd->thd", p, rows)


def query_blocks(fn, block: int, *xs):
    """``fn`` over ``xs`` (each ``[T, ...]``) ``block`` tokens at a time (``jax.lax.map``; the
    last block padded with zeros), the results ``[T, ...]``; one call when ``T <= block``."""
    T = xs[0].shape[0]
    if T <= block:
        return fn(*xs)
    n = -(-T // block)

    def split(x):
        x = jnp.pad(x, [(0, n * block - T)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n, block, *x.shape[1:])

    out = jax.lax.map(lambda a: fn(*a), tuple(split(x) for x in xs))
    return out.reshape(n * block, *out.shape[2:])[:T]


def gather_rows(pages: jax.Array, table: jax.Array, seq: jax.Array, idx: jax.Array) -> jax.Array:
    """Rows ``idx [T, N]`` (row index within the sequence, clipped at 0) of each token's
    sequence from ``pages [num_pages, rows, D]``: ``[T, N, D]``."""
    R = pages.shape[1]
    idx = jnp.maximum(idx, 0)
    page = jnp.take_along_axis(table[seq], jnp.minimum(idx // R, table.shape[1] - 1), axis=1)
    return pages.reshape(-1, pages.shape[-1])[page * R + idx % R]


class Dsv4Attention(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, kind: str, *, dtype, rngs: nnx.Rngs, kernels: KernelConfig | None = None
    ):
        v, h, H, D = cfg.dsv4, cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.kernels = kernels = kernels or KernelConfig()
        mesh = kernels.mesh
        # Tensor parallelism (``models/sharding.py``): queries and the attention's output
        # are pinned to the head split; XLA partitions the rest around them.
        self.heads_split = None if mesh is None else NamedSharding(mesh, P(None, AXIS, None))
        self.kind = LayerKind(kind)
        self.specs = paged_specs(cfg, kind)
        self.num_heads, self.head_dim, self.window = H, D, cfg.sliding_window
        self.o_groups, self.eps = v.o_groups, cfg.rms_norm_eps
        rot = v.qk_rope_head_dim
        if self.kind == LayerKind.SWA_MQA:
            inv_freq, scale = rope_frequencies(cfg.rope_theta, rot)
        else:
            inv_freq, scale = rope_frequencies(v.compress_rope_theta, rot, 1.0, v.compress_yarn)
        self.inv_freq, self.rope_scale = tuple(inv_freq.tolist()), scale  # static: hashable
        self.q_a_proj = Linear(h, v.q_lora_rank, bias=False, dtype=dtype, rngs=rngs)
        self.q_a_norm = RMSNorm(v.q_lora_rank, eps=cfg.rms_norm_eps, dtype=dtype)
        self.q_b_proj = Linear(v.q_lora_rank, H * D, bias=False, dtype=dtype, rngs=rngs)
        self.kv_proj = Linear(h, D, bias=False, dtype=dtype, rngs=rngs)
        self.kv_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        per_group = H * D // v.o_groups
        self.o_a = nnx.Param(
            (
                jax.random.normal(rngs.params(), (v.o_groups, per_group, v.o_lora_rank)) * per_group**-0.5
            ).astype(dtype)
        )
        self.o_b_proj = Linear(v.o_groups * v.o_lora_rank, h, bias=False, dtype=dtype, rngs=rngs)
        self.sinks = nnx.Param(jnp.zeros((H,), jnp.float32))
        compressed, sparse = self.kind != LayerKind.SWA_MQA, self.kind == LayerKind.CSA
        self.rate = v.rate(kind) if compressed else 0
        eps = cfg.rms_norm_eps
        self.compressor = (
            Compressor(h, D, self.rate, sparse, eps=eps, dtype=dtype, rngs=rngs) if compressed else None
        )
        d = v.index_head_dim
        # The lightning indexer (``csa``): its own compressed keys, queries and head weights.
        self.indexer = Compressor(h, d, self.rate, True, eps=eps, dtype=dtype, rngs=rngs) if sparse else None
        self.index_q_b_proj = (
            Linear(v.q_lora_rank, v.index_n_heads * d, bias=False, dtype=dtype, rngs=rngs) if sparse else None
        )
        self.index_weights_proj = (
            Linear(h, v.index_n_heads, bias=False, dtype=dtype, rngs=rngs) if sparse else None
        )
        self.index_heads, self.index_dim, self.topk = v.index_n_heads, d, v.index_topk
        # Per-tensor scales of the pages (``kv_quant.py``), per paged spec per field (the
        # window's rows, the entries, the indexer's keys, the state: 1.0); None: 1.0.
        # Static, set once the model is built (``CausalLM.set_kv_scales``).
        self.kv_scales = None

    def _scale(self, kind: CacheKind) -> float:
        """The scale of the one-field paged spec of ``kind`` (a K=V row or an indexer key)."""
        i = [s.kind for s in self.specs].index(kind)
        return field_scales(self.kv_scales, i, 1)[0]

    def _rope(self, x, positions):
        return rope_tail(x, positions, self.inv_freq, self.rope_scale)

    @jax.named_scope("dsv4_attention")
    def __call__(self, entry, x: jax.Array, batch: ForwardBatch):
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        pages = dict(zip((s.kind for s in self.specs), parts(entry, self.specs)))
        pos = batch.positions
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = constrain(self.q_b_proj(q_resid).reshape(T, H, D), self.heads_split)
        q = self._rope(rms_normalize(q, self.eps).astype(x.dtype), pos)
        kv = self._rope(self.kv_norm(self.kv_proj(x)), pos)
        window = pages[CacheKind.SWA]
        w_scale = self._scale(CacheKind.SWA)
        window = SharedKVPages(
            write_rows(window.kv, unscale(kv, w_scale), batch.slot_mappings[CacheKind.SWA])
        )
        new = {CacheKind.SWA: window}
        P = window.kv.shape[1]
        table = batch.page_tables[CacheKind.SWA]
        steps = Steps(batch, table.shape[0], P)
        seq = steps.seq
        # The window: positions pos - window + 1 .. pos of the token's sequence.
        back = jnp.arange(self.window, dtype=jnp.int32)[::-1]
        wpos = pos[:, None] - back[None, :]
        # Each token's rows: (pages, table, the pages' scale) at indices idx.
        sources = [(window.kv, table, w_scale)]
        idx, valid = [wpos], [(wpos >= 0) & steps.live[:, None]]
        if self.compressor is not None:
            c_pages, c_table, c_idx, c_valid = self._compressed(pages, new, x, q_resid, batch, steps)
            c_kind = CacheKind.CSA if self.kind == LayerKind.CSA else CacheKind.HCA
            sources.append((c_pages, c_table, self._scale(c_kind)))
            idx.append(c_idx)
            valid.append(c_valid)
        sinks = self.sinks[...]
        if self.kernels.attention_backend == "pallas":
            o = self._attend_sources(q, seq, sources, idx[1:], valid[1:], sinks, batch)
        else:
            o = self._attend_gathered(q, seq, sources, idx, valid, sinks)
        o = rope_tail(o, -pos, self.inv_freq, self.rope_scale).astype(x.dtype)  # rotate back
        o = jnp.einsum("tgi,gio->tgo", o.reshape(T, self.o_groups, -1), self.o_a[...])
        out = self.o_b_proj(o.reshape(T, -1))
        return join([new[s.kind] for s in self.specs], self.specs), out

    def _attend_gathered(self, q, seq, sources, idx, valid, sinks):
        """Plain JAX (the ``xla`` backend): each block of tokens gathers its rows of every
        source, then one softmax with the sink; float32 ``[T, H, D]``."""
        T, D = q.shape[0], self.head_dim

        def attend(q, seq, *idx_valid):
            n = len(sources)
            # Rows of scaled pages back to numbers (one softmax spans the sources).
            rows = [gather_rows(kv, t, seq, i) for (kv, t, _), i in zip(sources, idx_valid[:n])]
            rows = [r if s == 1.0 else dequantize(r, s) for r, (_, _, s) in zip(rows, sources)]
            ok = jnp.concatenate(idx_valid[n:], axis=1)
            return attend_rows(q, jnp.concatenate(rows, axis=1), ok, sinks, D**-0.5)

        width = sum(i.shape[1] for i in idx)  # rows each token reads
        most = max(8, min(QUERY_BLOCK, BLOCK_ROWS // width) // 8 * 8)
        n = -(-T // most)  # blocks of equal size (a multiple of 8), the least padding
        block = -(-T // (8 * n)) * 8
        return constrain(query_blocks(attend, block, q, seq, *idx, *valid), self.heads_split)

    def _attend_sources(self, q, seq, sources, idx, valid, sinks, batch: ForwardBatch):
        """The Pallas kernels (``pallas`` backend), an output and log-sum-exp per source,
        merged with the sink; float32 ``[T, H, D]``. The window (``sources[0]``: contiguous
        positions of each sequence) goes to the ragged paged attention kernel, which copies
        whole pages once per block of queries; the compressed entries (``idx``, ``valid``:
        a list per token) to the row kernel, which copies each listed row."""
        kernels, scale = self.kernels, self.head_dim**-0.5
        # A source's scale folds into its softmax scale (its log-sum-exp is then the true
        # one) and multiplies its output, before the merge.
        window, table, w_scale = sources[0]
        rows = window[:, :, None, :]  # [pages, page_size, 1, D]: one K=V head, a bitcast
        attend = sharded.latent_attention(
            backend.attention_fn("pallas", kernels.interpret),
            kernels.mesh,
            sm_scale=scale * w_scale,
            sliding_window=self.window,
            q_block=1 if batch.decode_only else PREFILL_Q_BLOCK["pallas"],
            return_lse=True,
        )
        o, lse = attend(q, rows, rows, batch.kv_lens, table, batch.cu_q_lens, batch.num_seqs)
        parts = [(rescale(o.astype(jnp.float32), w_scale), lse)]
        for (pages, table, s), i, ok in zip(sources[1:], idx, valid, strict=True):
            attend = sharded.row_attention(
                backend.row_attention_fn("pallas", kernels.interpret), kernels.mesh, sm_scale=scale * s
            )
            o, lse = attend(q, pages, table, seq, jnp.where(ok, i, -1))
            parts.append((rescale(o, s), lse))
        return constrain(merge_sources(parts, sinks), self.heads_split)

    def _compressed(self, pages, new, x, q_resid, batch: ForwardBatch, steps: Steps):
        """Write this step's compressed entries and states; the entries' pages and table, and
        the rows each token attends to there (``[T, N]`` indices) and which are valid."""
        entry_kind = CacheKind.CSA if self.kind == LayerKind.CSA else CacheKind.HCA
        state_kind = CacheKind.CSA_STATE if self.kind == LayerKind.CSA else CacheKind.HCA_STATE
        pos, r = batch.positions, self.rate
        comps = [self.compressor] + ([self.indexer] if self.indexer is not None else [])
        state_pages = pages[state_kind]
        prior = steps.prior(state_pages, batch.page_tables[state_kind])
        means, state = compress(comps, x, pos, steps, prior)
        new[state_kind] = steps.write_state(state_pages, *state, pos, batch.slot_mappings[state_kind])
        ends = (pos % r == r - 1) & steps.live
        starts = pos - r + 1  # where each completed window begins: its entry's position
        D = self.head_dim
        entries = self._rope(self.compressor.kv_norm(means[:, :D]), starts)
        slots = batch.slot_mappings[entry_kind]
        rows_at = jnp.where(ends & (slots >= 0), slots // r, -1)
        entries = unscale(entries, self._scale(entry_kind))
        stored = SharedKVPages(write_rows(pages[entry_kind].kv, entries, rows_at))
        new[entry_kind] = stored
        table = batch.page_tables[entry_kind]
        per_page = stored.kv.shape[1]
        visible = (pos + 1) // r  # entries 0 .. visible - 1 are complete
        if self.indexer is None:  # every visible entry
            idx = jnp.broadcast_to(
                jnp.arange(table.shape[1] * per_page, dtype=jnp.int32),
                (x.shape[0], table.shape[1] * per_page),
            )
            valid = (idx < visible[:, None]) & steps.live[:, None]
            return stored.kv, table, idx, valid
        k_scale = self._scale(CacheKind.INDEX)
        keys = unscale(self._rope(self.indexer.kv_norm(means[:, D:]), starts), k_scale)
        # The indexer's keys go to its own pool's pages: their indices match the entries'
        # only while every pool allocates alike (L2 loads and evictions are per cache kind).
        key_slots = batch.slot_mappings[CacheKind.INDEX]
        keys = IndexPages(
            write_rows(pages[CacheKind.INDEX].k, keys, jnp.where(ends & (key_slots >= 0), key_slots // r, -1))
        )
        new[CacheKind.INDEX] = keys
        T = x.shape[0]
        iq = self._rope(self.index_q_b_proj(q_resid).reshape(T, self.index_heads, self.index_dim), pos)
        w = self.index_weights_proj(x).astype(jnp.float32) * self.index_heads**-0.5
        w = rescale(w, k_scale)  # the keys' scale (relu is positively homogeneous)
        K = min(self.topk, table.shape[1] * per_page)
        index_table = batch.page_tables[CacheKind.INDEX]
        idx = top_k_rows(iq, w, keys.k, index_table, batch, visible - 1, K, self.kernels)
        valid = (idx >= 0) & steps.live[:, None]
        return stored.kv, table, idx, valid
