"""Ragged paged attention as a Pallas TPU kernel (the KV page write is in ``kv_write.py``).

Same interface and semantics as ``reference.py``; runs on TPU (Mosaic) and, with
``interpret=True`` (or ``pltpu.InterpretParams()``), on CPU. ``check_shapes`` refuses, up
front, the configurations Mosaic cannot compile.

Grid: one step per query block of ``q_block`` rows that never crosses a sequence boundary
(the layout of ``reference.py``: ``cdiv(T, q_block) + S`` steps, the tail idle). Each step
walks only the KV pages its rows can see, ``kv_block_pages`` pages per inner-loop step,
copying them from HBM into a double-buffered VMEM scratch (block ``c + 1`` is in flight
while block ``c`` is computed)::

    positions  0 ........ lo .................... pos0 ...... hi-1 ..... kv_len-1
                          |<-- window of row 0 -->|                 |
    pages      [  skipped  ][ loaded: p_lo .. p_hi-1, kbp per step ][ skipped ]
                            lo = max(0, pos0 - window + 1), hi = pos0 + rows (causal)

Pages before ``p_lo`` and from ``p_hi`` on are neither copied nor computed, and their
page-table entries are never read, so they may hold NaN or garbage page ids. Inside the
loaded pages, keys outside ``[lo, hi)`` are masked, and their values zeroed, because a
page that straddles the window edge or ``kv_len`` may hold NaN in those slots.

A page is copied as rows of at most 128 lanes, in the order the TPU stores
``[page_size, Hkv, D]`` (tiled on ``(Hkv, D)``, so for ``D = 128 * nc`` a token's heads
come chunk by chunk): row ``(t * nc + c) * Hkv + h`` is lanes ``128c ..`` of head ``h`` at
token ``t``, and the view is a bitcast, not a copy of the pool. Head ``h``'s keys are then
strided loads, one per 128-lane chunk, which Mosaic supports only on <= 128-lane rows.

8-bit pages (``--kv_cache_dtype`` float8_e4m3fn, float8_e5m2, int8) are copied as they are
(half of bfloat16's HBM bytes) and widened to float32 in VMEM once per KV step (``_stage``),
then read as float32 pages are; the caller folds the scales (``models/kv_quant.py``). XLA
keeps an 8-bit pool in the kernel's row order at the shapes of Llama-3-8B (8 KV heads of 128
per chip) and with one KV head; at some others (2 KV heads of 128, 2 or 4 of 256, seen on
v5e and v6e) it lays the pool out otherwise and copies it into the kernel's order every call,
as it does for ``D = 64`` pools of any dtype (a known cost, not a wrong result).

The page table is scalar-prefetched into SMEM (1 MiB) while it takes at most half of it;
a wider one (64 sequences of 4,096 pages: all of it) stays in HBM, and each query block
first copies the entries it reads (``_table_copy``).

Tiles (``plan``, for the chip traced for), with ``R = q_block * G`` and ``C = kbp * page_size``:
``q_block`` (prefill) is the largest power of two with ``R <=`` the MXU's rows and
``q_block <= T / S`` (what a sequence brings on average), at least 8; ``kbp`` copies about
``KV_STEP_BYTES`` of K and V per step, within ``KV_TOKENS`` and ``SCORE_TILE`` (``R x C``),
and no more pages than a block can span. Then both halve (KV first, down to 128 tokens;
the queries, down to 8 rows; KV, down to one page) until ``vmem_bytes`` (tile-padded) fits
``vmem.tile_budget()``; ``vmem.compiler_params`` declares the budget as the limit::

    2 (K, V) x 2 (double buffer) x C x Hkv x D x kv_bytes      the copied pages
  + 2 (K, V) x C x Hkv x D x 4                                8-bit pages widened (``_stage``)
  + 2 (q, out) x 2 (Pallas double-buffers blocks) x Hkv x R x D x q_bytes
  + Hkv x R x (D + 2 x 128) x 4                               f32 acc, m and l scratch
  + 2 x R x C x 4                                             one head's scores, probabilities
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hicache_jax.models.kernels import vmem

NEG_INF = float("-inf")
LANES = 128
KV_STEP_BYTES = 1 << 20  # K and V bytes one inner step copies: DMAs large against their latency
KV_TOKENS = (128, 1024)  # ... but within these many tokens per step
SCORE_TILE = 128 * 1024  # and at most this many f32 scores [R, C] per head and step
TABLE_SMEM_SHARE = 0.5  # of SMEM, the most a scalar-prefetched page table may take
DTYPES = ("float32", "bfloat16")
QUANTIZED = ("float8_e4m3fn", "float8_e5m2", "int8")  # 8-bit pages, widened in VMEM (``_stage``)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _quantized(dtype) -> bool:
    return jnp.dtype(dtype).name in QUANTIZED


def _staged(dtype):
    """The dtype a step's K and V are read in: 8-bit pages are widened to float32 in VMEM
    once per KV step (``_stage``), then read as float32 pages are."""
    return jnp.dtype(jnp.float32) if _quantized(dtype) else jnp.dtype(dtype)


def _units(num_kv_heads: int, head_dim: int, dtype) -> tuple[int, int]:
    """``(U, W)``: a token's K (or V) is ``U`` rows of ``W`` lanes in the copied pages."""
    if head_dim % LANES or (num_kv_heads == 1 and jnp.dtype(dtype).itemsize <= 2):
        # D <= 128: a row per head. One bf16 or 8-bit head of D = 128n: TPUs store
        # [page_size, D] tiled on (token, D) rows, which the kernel reads whole (no strided load).
        return num_kv_heads, head_dim
    return num_kv_heads * (head_dim // LANES), LANES


def _page_rows(pages: jax.Array) -> jax.Array:
    """``[num_pages, page_size, Hkv, D] -> [num_pages, page_size * U, W]``, unit
    ``u = c * Hkv + h`` (chunk ``c`` of head ``h``) of token ``t`` at row ``t * U + u``: the
    order the TPU stores the pages in, so XLA makes this a bitcast."""
    num_pages, page_size, Hkv, D = pages.shape
    U, W = _units(Hkv, D, pages.dtype)
    x = pages.reshape(num_pages, page_size, Hkv, U // Hkv, W).swapaxes(2, 3)
    return x.reshape(num_pages, page_size * U, W)


def unsupported_reason(*, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype) -> str | None:
    """Why Mosaic cannot compile the kernel for these per-shard shapes (None: it can).

    ``dtype`` is the KV pages'. Rules: float32 or bfloat16, or an 8-bit dtype (which chips
    compile it: ``models/kernels/kv_dtypes.py``); query heads
    group evenly over KV heads; ``head_dim`` at most 128 or a multiple of 128 (strided loads
    take rows of <= 128 lanes), unless there is one KV head, whose rows are read whole (an
    MLA latent: 512 + 64); bfloat16 with one KV head or an even number, since it picks a
    head's rows by 32-bit loads of head pairs (Mosaic has no 16-bit strided load).
    """
    name = jnp.dtype(dtype).name
    if name not in DTYPES + QUANTIZED:
        return f"dtype={name}: the kernel takes {', '.join(DTYPES + QUANTIZED)} KV pages"
    if num_q_heads % num_kv_heads:
        return f"num_q_heads={num_q_heads} do not group over num_kv_heads={num_kv_heads}"
    if head_dim > LANES and head_dim % LANES and num_kv_heads > 1:
        return f"head_dim={head_dim}: must be <= {LANES} or a multiple of {LANES} (TPU lanes)"
    if name == "bfloat16" and num_kv_heads > 1 and num_kv_heads % 2:
        return f"num_kv_heads={num_kv_heads} per shard in bfloat16: must be 1 or even (heads load in pairs)"
    return None


def check_shapes(*, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype) -> None:
    """Raise ``ValueError`` naming the value when the kernel cannot compile these shapes."""
    heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    reason = unsupported_reason(**heads, head_dim=head_dim, dtype=dtype)
    if reason:
        raise ValueError(f"pallas ragged paged attention: {reason}")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The static shapes one call is traced for (per shard)."""

    num_tokens: int  # T
    num_seqs: int  # S
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_pages: int
    q_dtype: Any
    kv_dtype: Any
    sliding_window: int | None = None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def span_pages(self, q_block: int) -> int:
        """Pages one query block can touch: its rows' keys ``[lo, hi)`` cover at most
        ``window - 1 + q_block`` positions, starting anywhere in a page."""
        if not self.sliding_window:
            return self.max_pages
        keys = self.sliding_window - 1 + q_block
        return min(self.max_pages, -(-(keys + self.page_size - 1) // self.page_size))

    def num_blocks(self, q_block: int) -> int:
        T, S = self.num_tokens, self.num_seqs
        return T if q_block == 1 else pl.cdiv(T, q_block) + S


def vmem_bytes(shapes: Shapes, q_block: int, kv_block_pages: int) -> int:
    """VMEM the kernel's buffers take (the rule in the module docstring, padded to tiles)."""
    s = shapes
    U, W = _units(s.num_kv_heads, s.head_dim, s.kv_dtype)
    kv_item, q_item = jnp.dtype(s.kv_dtype).itemsize, jnp.dtype(s.q_dtype).itemsize
    C = kv_block_pages * s.page_size
    R, D = q_block * s.group, _round_up(s.head_dim, LANES)
    kv = 2 * 2 * C * U * _round_up(W, LANES) * kv_item
    qo = 2 * 2 * s.num_kv_heads * _round_up(R, 32 // q_item) * D * q_item
    f32 = s.num_kv_heads * _round_up(R, 8) * (D + 2 * LANES) * 4
    work = 2 * _round_up(R, 8) * _round_up(C, LANES) * 4
    if _quantized(s.kv_dtype):  # one step's K and V widened to float32 (``_stage``)
        kv += 2 * C * U * _round_up(W, LANES) * 4
    return kv + qo + f32 + work


def _mxu_rows() -> int:
    try:
        return int(pltpu.get_tpu_info().mxu_column_size)
    except Exception:  # not tracing for a TPU
        return 128


def plan(shapes: Shapes, q_block: int | None = None, kv_block_pages: int | None = None) -> tuple[int, int]:
    """``(q_block, kv_block_pages)`` for the chip being traced for (the module docstring's
    rule); values given are kept as they are."""
    s = shapes
    if q_block is None:
        per_seq = max(8, s.num_tokens // max(1, s.num_seqs))
        q_block = _pow2_floor(max(8, min(_mxu_rows() // s.group, per_seq)))
    if kv_block_pages:
        return q_block, min(kv_block_pages, s.span_pages(q_block))
    token_bytes = 2 * s.num_kv_heads * s.head_dim * jnp.dtype(s.kv_dtype).itemsize
    tokens = min(KV_STEP_BYTES // token_bytes, KV_TOKENS[1], SCORE_TILE // (q_block * s.group))
    kbp = max(1, min(max(tokens, KV_TOKENS[0]) // s.page_size, s.span_pages(q_block)))
    budget = vmem.tile_budget()
    while vmem_bytes(s, q_block, kbp) > budget:
        if kbp > 1 and kbp * s.page_size > KV_TOKENS[0]:
            kbp //= 2
        elif q_block > 8:
            q_block //= 2
        elif kbp > 1:
            kbp //= 2
        else:
            raise ValueError(
                f"pallas ragged paged attention: one page and {q_block} query rows take "
                f"{vmem_bytes(s, q_block, kbp)} bytes of VMEM, over the {budget}-byte budget ({s})"
            )
    return q_block, kbp


def _table_copy(shapes: Shapes, q_block: int) -> int | None:
    """None: scalar-prefetch the whole page table into SMEM, while it takes at most
    ``TABLE_SMEM_SHARE`` of it. Else the table stays in HBM (flat, padded to 128 entries)
    and each query block copies this many entries, from a 128-aligned offset, to SMEM: what
    it reads and more."""
    try:
        smem = int(pltpu.get_tpu_info().smem_capacity_bytes)
    except Exception:  # not tracing for a TPU
        smem = 1 << 20
    entries = shapes.num_seqs * shapes.max_pages
    if entries * 4 <= smem * TABLE_SMEM_SHARE:
        return None
    return min(_round_up(shapes.span_pages(q_block), LANES) + LANES, _round_up(entries, LANES))


def cost(shapes: Shapes, q_block: int, kv_block_pages: int, soft_cap: float | None) -> pl.CostEstimate:
    """An upper bound from the static shapes (``kv_lens`` are not known at trace time):
    every one of the ``NB`` blocks is real, full and sees ``span_pages`` pages (all of its
    table row, or what its window allows). It computes those pages' keys rounded up to
    whole KV steps (two dots, 2 flops a multiply-add: ``4 R C D`` per head and step; an exp,
    and a tanh under a soft cap, per score), and copies the pages themselves (steps skip
    the tail pages), its q block in and its out block back."""
    s = shapes
    NB, R = s.num_blocks(q_block), q_block * s.group
    pages = s.span_pages(q_block)
    keys = pl.cdiv(pages, kv_block_pages) * kv_block_pages * s.page_size
    scores = NB * s.num_kv_heads * R * keys
    page_bytes = s.page_size * s.num_kv_heads * s.head_dim * jnp.dtype(s.kv_dtype).itemsize
    q_bytes = s.num_kv_heads * R * s.head_dim * jnp.dtype(s.q_dtype).itemsize
    L = _table_copy(s, q_block)
    table = s.num_seqs * s.max_pages if L is None else NB * L
    return pl.CostEstimate(
        flops=4 * scores * s.head_dim,
        transcendentals=scores * (2 if soft_cap else 1),
        bytes_accessed=NB * (2 * pages * page_bytes + 2 * q_bytes) + 4 * (table + 3 * NB),
    )


def _query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens: int, q_block: int):
    """Cut the ragged queries into blocks of ``q_block`` rows, one sequence each.

    Returns per block (all ``[NB]`` int32): its sequence, its first row in ``q``, how many
    of its rows are real (0 for the idle tail) and the KV position of its first row.
    """
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    q_lens = jnp.where(jnp.arange(S) < num_seqs, q_lens, 0)
    nblk = (q_lens + q_block - 1) // q_block  # [S]
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    # sum(ceil(q_len / q_block)) <= floor(T / q_block) + S: this many steps always suffice.
    NB = num_tokens if q_block == 1 else pl.cdiv(num_tokens, q_block) + S
    b = jnp.arange(NB)
    seq = jnp.minimum(jnp.searchsorted(blk_end, b, side="right"), S - 1).astype(jnp.int32)
    first = (b - blk_start[seq]) * q_block  # first row of the block within its sequence
    rows = jnp.where(b < blk_end[-1], jnp.clip(q_lens[seq] - first, 0, q_block), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + first
    start = cu_q_lens[seq] + first
    return seq, start.astype(jnp.int32), rows.astype(jnp.int32), pos0.astype(jnp.int32)


def _heads_per_load(U: int, num_kv_heads: int, dtype) -> int:
    """KV heads whose tiles one set of loads yields: bf16 heads come in pairs (below)."""
    return 2 if dtype == jnp.bfloat16 and U > 1 and num_kv_heads % 2 == 0 else 1


def _head_tiles(buf, C: int, num_kv_heads: int, j) -> list:
    """The ``[C, D]`` tiles of KV heads ``n * j .. n * j + n - 1`` (``n = _heads_per_load``;
    ``j`` traced when ``n == 1``) of a ``[C * U, W]`` buffer (``_page_rows``).

    Unit ``u = c * Hkv + h`` of every token is every U-th row from row ``u``: a strided
    load. Mosaic packs two bf16 rows into each 32-bit sublane, so a row stride over bf16
    would pick half-words; instead one 32-bit strided load fetches the unit pair (2m, 2m + 1),
    chunk c of heads 2j and 2j + 1, row 2m in the low half; and a bf16 moved to the high half
    of a 32-bit word is that value as f32. A head's chunks join on lanes (whole vregs).
    """
    U = buf.shape[0] // C
    nc = U // num_kv_heads

    def join(chunks):
        return chunks[0] if nc == 1 else jnp.concatenate(chunks, axis=1)

    if U == 1:
        return [buf[pl.ds(0, C), :]]
    if _heads_per_load(U, num_kv_heads, buf.dtype) == 2:
        words = buf.bitcast(jnp.uint32)  # [C * U / 2, W]
        lo, hi = [], []
        for c in range(nc):
            w = words[pl.ds(c * num_kv_heads // 2 + j, C, stride=U // 2), :]  # [C, W] u32
            lo.append(pltpu.bitcast(w << 16, jnp.float32).astype(buf.dtype))
            hi.append(pltpu.bitcast(w & jnp.uint32(0xFFFF0000), jnp.float32).astype(buf.dtype))
        return [join(lo), join(hi)]
    return [join([buf[pl.ds(c * num_kv_heads + j, C, stride=U), :] for c in range(nc)])]


STAGE_ROWS = 256  # 8-bit rows widened per loop step (32 float32 vregs at 128 lanes)


def _stage(buf, wide, page_rows: int, n_pages):
    """Widen the rows of the first ``n_pages`` pages (``page_rows`` rows each) of an 8-bit
    step buffer ``buf`` ``[kbp * page_rows, W]`` into ``wide`` (float32, same shape): the
    dequantization, in VMEM, after the page DMA (the scale is the caller's, folded outside
    the kernel). Chunks start at multiples of 32 rows (an 8-bit tile), so the last may
    widen stale rows past the pages: those, like the buffer's own, are masked."""
    total = buf.shape[0]
    chunk = math.gcd(total, STAGE_ROWS)

    def body(i, carry):
        rows = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        wide[rows, :] = buf[rows, :].astype(jnp.float32)
        return carry

    lax.fori_loop(0, (n_pages * page_rows + chunk - 1) // chunk, body, 0)


def _attention_kernel(
    *refs,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    page_size: int,
    kbp: int,
    max_pages: int,
    group: int,
    num_kv_heads: int,
    table_in_smem: bool,
    with_sinks: bool,
    with_lse: bool = False,
):
    sink_ref = None
    if table_in_smem:
        (table_ref, blk_seq_ref, blk_rows_ref, blk_pos_ref, q_ref, k_hbm, v_hbm, *rest) = refs
    else:
        (blk_seq_ref, blk_rows_ref, blk_pos_ref, q_ref, k_hbm, v_hbm, table_hbm, *rest) = refs
    if with_sinks:
        sink_ref, *rest = rest
    o_ref, *scratch = rest
    lse_ref = None
    if with_lse:  # [1, Hkv, R, 1] f32: each row's log-sum-exp (the sink included, if any)
        lse_ref, *scratch = scratch
    if not table_in_smem:
        *scratch, ids_ref, ids_sem = scratch
    # Scalar prefetch (SMEM): table_ref [S * max_pages] int32 (flattened; else table_hbm in
    # HBM, copied per block into ids_ref [L]), blk_seq_ref, blk_rows_ref (real rows; 0: idle)
    # and blk_pos_ref (KV position of the first row), each [NB] int32.
    # q_ref, o_ref: [1, Hkv, R, D] VMEM, R = q_block * G rows ordered (row, group).
    # k_hbm, v_hbm: [num_pages, page_size * U, W] ANY (``_page_rows``).
    # sink_ref (with sinks): [Hkv, R, 1] f32 VMEM, each row's head's sink logit.
    # k_buf, v_buf: [2, kbp * page_size * U, W] VMEM double buffers; sems: [2] DMA, one per
    # slot; m_ref, l_ref: [Hkv, R, 1] f32 running max and denominator; acc_ref: [Hkv, R, D].
    # k_wide, v_wide (8-bit pages): [kbp * page_size * U, W] float32, one step's K and V.
    k_buf, v_buf, sems, m_ref, l_ref, acc_ref, *wide = scratch
    R = q_ref.shape[2]
    C = kbp * page_size  # KV tokens per inner step
    page_rows = k_hbm.shape[1]
    heads_per_load = _heads_per_load(page_rows // page_size, num_kv_heads, _staged(k_buf.dtype))
    b = pl.program_id(0)
    n_rows = blk_rows_ref[b]

    @pl.when(n_rows == 0)
    def _idle():
        o_ref[...] = jnp.zeros_like(o_ref)
        if lse_ref is not None:
            lse_ref[...] = jnp.full_like(lse_ref, NEG_INF)

    @pl.when(n_rows > 0)
    def _attend():
        seq = blk_seq_ref[b]
        pos0 = blk_pos_ref[b]
        hi = pos0 + n_rows  # one past the last key any row of the block may see
        lo = jnp.maximum(pos0 - sliding_window + 1, 0) if sliding_window else jnp.int32(0)
        p_lo = lo // page_size
        p_hi = (hi + page_size - 1) // page_size
        n_kv_blocks = (p_hi - p_lo + kbp - 1) // kbp

        if table_in_smem:

            def page_id(p):
                return table_ref[seq * max_pages + p]

        else:
            # Copy L entries from ``a``, a multiple of 128 (1-D DMA offsets are tile-aligned)
            # at most 127 before the block's first entry; L covers its pages past that.
            L, total = ids_ref.shape[0], table_hbm.shape[0]
            row = seq * max_pages
            a = pl.multiple_of(jnp.minimum((row + p_lo) // LANES * LANES, total - L), LANES)
            ids_copy = pltpu.make_async_copy(table_hbm.at[pl.ds(a, L)], ids_ref, ids_sem)
            ids_copy.start()
            ids_copy.wait()

            def page_id(p):
                return ids_ref[row + p - a]

        def page_copies(kv_blk, slot, j):
            """Descriptors of page ``j`` of KV block ``kv_blk``; read only when it is needed."""
            page = page_id(p_lo + kv_blk * kbp + j)
            dst = pl.ds(j * page_rows, page_rows)
            return (
                pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, dst], sems.at[slot]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, dst], sems.at[slot]),
            )

        def for_needed_pages(kv_blk, slot, action):
            # A KV block's tail pages from p_hi on are skipped (their buffer rows stay stale
            # and are masked below); starts and waits walk the same pages.
            first_page = p_lo + kv_blk * kbp
            n = jnp.minimum(kbp, p_hi - first_page)

            def each(j, carry):
                for copy in page_copies(kv_blk, slot, j):
                    action(copy)
                return carry

            lax.fori_loop(0, n, each, 0)

        for_needed_pages(0, 0, lambda c: c.start())
        if sink_ref is None:
            m_ref[...] = jnp.full_like(m_ref, NEG_INF)
            l_ref[...] = jnp.zeros_like(l_ref)
        else:  # the sink joins the denominator as one more logit, with no value
            m_ref[...] = sink_ref[...]
            l_ref[...] = jnp.ones_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

        def kv_step(kv_blk, carry):
            slot = kv_blk % 2

            @pl.when(kv_blk + 1 < n_kv_blocks)
            def _prefetch_next():
                for_needed_pages(kv_blk + 1, 1 - slot, lambda c: c.start())

            for_needed_pages(kv_blk, slot, lambda c: c.wait())
            if wide:
                n_pages = jnp.minimum(kbp, p_hi - (p_lo + kv_blk * kbp))
                _stage(k_buf.at[slot], wide[0], page_rows, n_pages)
                _stage(v_buf.at[slot], wide[1], page_rows, n_pages)
            k_src, v_src = (wide[0], wide[1]) if wide else (k_buf.at[slot], v_buf.at[slot])

            base = (p_lo + kv_blk * kbp) * page_size  # KV position of column 0

            def attend(h, k, v):  # one KV head h (may be traced): k, v [C, D]
                # Row r of the head's [R, D] query tile is query row i = r // G of the block,
                # at position pos0 + i. With d = k_pos - pos0 the masks compare d * G with r,
                # which avoids a vector division: i >= d <=> r >= d * G, i < d <=> r < d * G.
                # (Rebuilt per head: cheaper than keeping [R, C] masks live across heads.)
                r = lax.broadcasted_iota(jnp.int32, (R, C), 0)  # [R, C]
                d = base - pos0 + lax.broadcasted_iota(jnp.int32, (R, C), 1)  # [R, C]
                mask = (r < n_rows * group) & (d * group <= r)  # a real row, causal
                if sliding_window:
                    mask &= r < (d + sliding_window) * group  # key > q_pos - window
                # Values outside [lo, hi) may be NaN (or stale buffer rows): zero them,
                # since 0 * NaN would survive a zero probability.
                v_pos = base + lax.broadcasted_iota(jnp.int32, (C, 1), 0)  # [C, 1]
                v = jnp.where((v_pos >= lo) & (v_pos < hi), v, jnp.zeros_like(v))

                q = q_ref[0, h]  # [R, D]
                # Widened 8-bit values are exact in bfloat16 (at most 8 significant bits).
                k, v = k.astype(q.dtype), v.astype(q.dtype)
                # Explicit, so jax_default_matmul_precision=highest (the tests') cannot ask
                # Mosaic for an f32 contraction of bf16 operands, which it refuses.
                f32 = q.dtype == jnp.float32
                precision = lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT
                s = lax.dot_general(
                    q,
                    k,
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )  # [R, C]
                s = s * sm_scale
                if soft_cap:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, NEG_INF)

                m_prev = m_ref[h]  # [R, 1]
                m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with no key yet
                p = jnp.exp(s - m_safe)  # [R, C]
                alpha = jnp.exp(m_prev - m_safe)  # [R, 1]
                l_ref[h] = alpha * l_ref[h] + p.sum(axis=-1, keepdims=True)
                pv = lax.dot_general(
                    p.astype(v.dtype),
                    v,
                    (((1,), (0,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )  # [R, D]
                acc_ref[h] = alpha * acc_ref[h] + pv
                m_ref[h] = m_new

            def heads(j, carry):
                ks = _head_tiles(k_src, C, num_kv_heads, j)
                vs = _head_tiles(v_src, C, num_kv_heads, j)
                for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
                    attend(j * len(ks) + i, k, v)
                return carry

            # A loop over heads keeps the code (and the compile time) one head's worth; bf16
            # pairs unroll, since a traced start on the u32 view needs a tile-aligned slice.
            if heads_per_load == 2:
                for j in range(num_kv_heads // 2):
                    heads(j, 0)
            else:
                lax.fori_loop(0, num_kv_heads, heads, 0)
            return carry

        lax.fori_loop(0, n_kv_blocks, kv_step, 0)
        l = l_ref[...]
        out = acc_ref[...] / jnp.where(l == 0.0, 1.0, l)  # [Hkv, R, D]; rows with no key: 0
        o_ref[0] = out.astype(o_ref.dtype)
        if lse_ref is not None:
            lse_ref[0] = jnp.where(l == 0.0, NEG_INF, m_ref[...] + jnp.log(jnp.where(l == 0.0, 1.0, l)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "q_block",
        "kv_block_pages",
        "interpret",
        "return_lse",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    kv_lens: jax.Array,  # [S] int32
    page_tables: jax.Array,  # [S, max_pages] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [] int32
    sinks: jax.Array | None = None,  # [Hq] f32: a learned logit per head (gpt-oss), or None
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    q_block: int | None = None,
    kv_block_pages: int | None = None,
    interpret: Any = False,
    return_lse: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """``q_block``: 1 for decode-only batches; ``None`` picks from the chip's VMEM (``plan``),
    as does ``kv_block_pages=None``. ``return_lse``: also each row's log-sum-exp ``[T, Hq]``
    float32 (the sink included; -inf where a row sees no key), for a caller that merges
    this attention with another's (DeepSeek V4's window and compressed entries)."""
    T, Hq, D = q.shape
    num_pages, page_size, Hkv, _ = k_pages.shape
    S, max_pages = page_tables.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not group over {Hkv} KV heads")
    if not interpret:
        check_shapes(num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, dtype=k_pages.dtype)
    shapes = Shapes(T, S, Hq, Hkv, D, page_size, max_pages, q.dtype, k_pages.dtype, sliding_window)
    Bq, kbp = plan(shapes, q_block, kv_block_pages)
    G = Hq // Hkv
    R = Bq * G

    seq, start, rows, pos0 = _query_blocks(cu_q_lens, kv_lens, num_seqs, T, Bq)
    NB = seq.shape[0]
    i = jnp.arange(Bq)
    q_rows = jnp.where(i[None, :] < rows[:, None], start[:, None] + i[None, :], T)  # [NB, Bq]
    # Gather each block's rows and put a KV head's G query heads under it: [NB, Hkv, R, D].
    qb = q.at[jnp.minimum(q_rows, T - 1)].get().reshape(NB, Bq, Hkv, G, D)
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, R, D)
    k_rows, v_rows = _page_rows(k_pages), _page_rows(v_pages)  # [num_pages, page_size * U, W]
    table = page_tables.reshape(-1).astype(jnp.int32)
    L = _table_copy(shapes, Bq)

    kernel = functools.partial(
        _attention_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        page_size=page_size,
        kbp=kbp,
        max_pages=max_pages,
        group=G,
        num_kv_heads=Hkv,
        table_in_smem=L is None,
        with_sinks=sinks is not None,
        with_lse=return_lse,
    )
    block = pl.BlockSpec((1, Hkv, R, D), lambda b, *_: (b, 0, 0, 0))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    buf_shape = (2, kbp * k_rows.shape[1], k_rows.shape[2])
    scratch = [
        pltpu.VMEM(buf_shape, k_pages.dtype),
        pltpu.VMEM(buf_shape, v_pages.dtype),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((Hkv, R, 1), jnp.float32),
        pltpu.VMEM((Hkv, R, 1), jnp.float32),
        pltpu.VMEM((Hkv, R, D), jnp.float32),
    ]
    if _quantized(k_pages.dtype):  # one step's K and V widened to float32 (``_stage``)
        scratch += [pltpu.VMEM(buf_shape[1:], jnp.float32)] * 2
    prefetch, inputs = (seq, rows, pos0), [qb, vmem.in_hbm(k_rows, interpret), vmem.in_hbm(v_rows, interpret)]
    in_specs = [block, any_space, any_space]
    if L is None:
        prefetch = (table, *prefetch)
    else:
        inputs.append(jnp.pad(table, (0, _round_up(table.shape[0], LANES) - table.shape[0])))
        in_specs.append(any_space)
        scratch += [pltpu.SMEM((L,), jnp.int32), pltpu.SemaphoreType.DMA(())]
    if sinks is not None:  # row r of a head's tile is query head (r % G) of that KV head
        rows_sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(Hkv, 1, G), (Hkv, Bq, G))
        inputs.append(rows_sink.reshape(Hkv, R, 1))
        in_specs.append(pl.BlockSpec((Hkv, R, 1), lambda b, *_: (0, 0, 0)))
    lse_specs = [pl.BlockSpec((1, Hkv, R, 1), lambda b, *_: (b, 0, 0, 0))] if return_lse else []
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(NB,),
            in_specs=in_specs,
            out_specs=[block, *lse_specs],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((NB, Hkv, R, D), q.dtype),
            *([jax.ShapeDtypeStruct((NB, Hkv, R, 1), jnp.float32)] if return_lse else []),
        ],
        # Every step starts and drains its own copies, so steps may run in any order.
        compiler_params=vmem.compiler_params(("parallel",)),
        cost_estimate=cost(shapes, Bq, kbp, soft_cap),
        interpret=interpret,
    )(*prefetch, *inputs)

    out, *lse = out
    out = out.reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    out = jnp.zeros((T, Hq, D), q.dtype).at[q_rows.reshape(-1)].set(out, mode="drop")
    if not return_lse:
        return out
    lse = lse[0].reshape(NB, Hkv, Bq, G).transpose(0, 2, 1, 3).reshape(NB * Bq, Hq)
    return out, jnp.full((T, Hq), NEG_INF, jnp.float32).at[q_rows.reshape(-1)].set(lse, mode="drop")
