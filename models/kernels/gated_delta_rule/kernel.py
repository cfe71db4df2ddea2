"""Gated DeltaNet as Pallas TPU kernels: ragged chunked prefill (``gdn_ragged``, here) and the
one-token decode update (``gdn_decode``, in ``decode_kernel.py``). Both read each sequence's
initial state from its slot in the state pool and write the final state back to that slot
inside the kernel; the pool is aliased input -> output, so under a jit that donates it the
update is in place. Shaped like the Mamba2 SSD kernels (``mamba2_ssd/kernel.py``).

Prefill walks the flat batch in token blocks of ``chunk`` rows, a block's *segments* (sequence
∩ block) in order, carrying each sequence's state across blocks: the walk is
``segment_scan``'s, shared with the SSD kernel; this module holds the chunk of the recurrence
per segment.

Within a segment, rows outside it are masked to ``q = k = v = 0, g = beta = 0``: they neither
decay nor write the state and their o is 0, so every segment is one chunk of the UT-transform
form of ``chunked.py`` with the carried state. Masking with ``where`` also keeps NaN in
padding rows out of the results. The chunk's triangular system ``(I + L)^-1`` is inverted by
recursive doubling of diagonal blocks (``chunked.ut_inverse``): matmuls only.

Layouts, chosen so every block meets the TPU (8, 128) tiling: q, k [T, H*Dk], v and o
[T, H*Dv] (free reshapes; a head is a static lane slice), g and beta [H/HB, T, HB]
(transposes that fuse into their producer under jit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hicache_jax.models.kernels import segment_scan, vmem
from hicache_jax.models.kernels.mamba2_ssd.kernel import (
    F32,
    HIGHEST,
    _dot,
    _head_major,
    _tiled_bytes,
)

# Heads are unrolled in the kernel bodies; more grows code and compile time. A prefill head
# is ~20 matmuls of a chunk, enough to keep the MXU busy on its own, and compiling for v5e
# took 1.2 s with 2 heads against 4.4 s with 8 (chunk 64, head dims 128); a decode head is a
# few [1, D] x [D, D] products, so decode takes up to 8.
MAX_HEAD_BLOCK = {"ragged": 2, "decode": 8}


def ragged_vmem_bytes(head_block: int, chunk: int, Dk: int, Dv: int, dtype) -> int:
    """Upper bound on ``gdn_ragged``'s VMEM: double-buffered q/k/v/g/beta/o blocks, the
    [HB, Dk, Dv] state scratch and the values of the segment body (per unrolled head about
    eight [Q, Q] and eight [Q, D] f32 values and one [Dk, Dv] update, plus the shared masks
    and cumsum operands). ``test_chosen_blocks_fit_the_budget`` (tests/tpu) compiles the
    largest shapes with the scoped limit cut to this bound."""
    Q, HB = chunk, head_block
    blocks = 2 * _tiled_bytes((Q, HB * Dk), dtype) + _tiled_bytes((Q, HB * Dv), dtype)  # q, k, v
    blocks += _tiled_bytes((Q, HB * Dv), F32) + 2 * _tiled_bytes((Q, HB), F32)  # o, g, beta
    state = _tiled_bytes((HB, Dk, Dv), F32)
    qq, qd, dd = _tiled_bytes((Q, Q), F32), _tiled_bytes((Q, max(Dk, Dv)), F32), _tiled_bytes((Dk, Dv), F32)
    values = HB * (8 * qq + 8 * qd + dd) + 8 * qq + (1 << 20)
    return 2 * blocks + state + values


def decode_vmem_bytes(head_block: int, Dk: int, Dv: int, dtype) -> int:
    """Upper bound on ``gdn_decode``'s VMEM: the double-buffered blocks (one token row, the
    state read), the two write-back buffers and the head loop's [Dk, Dv] values."""
    HB = head_block
    state = _tiled_bytes((HB, Dk, Dv), F32)
    blocks = 2 * _tiled_bytes((1, HB * Dk), dtype) + _tiled_bytes((1, HB * Dv), dtype)  # q, k, v
    blocks += _tiled_bytes((1, HB * Dv), F32) + 2 * _tiled_bytes((1, HB), F32)  # o, g, beta
    return 2 * (blocks + state) + 2 * state + state + (512 << 10)


def head_blocks(num_heads: int, head_k_dim: int, head_v_dim: int) -> list[int]:
    """Head blocks the kernels accept, largest first: they divide H and span whole 128-lane
    tiles of q, k and v (or are all heads, a whole dim)."""
    H = num_heads
    lanes = lambda hb: (hb * head_k_dim) % 128 == 0 and (hb * head_v_dim) % 128 == 0
    return [hb for hb in range(H, 0, -1) if H % hb == 0 and (lanes(hb) or hb == H)]


def pick_head_block(num_heads: int, head_k_dim: int, head_v_dim: int, dtype, chunk: int | None = None) -> int:
    """The head block for ``gdn_ragged`` (``chunk`` rows per token block) or, with ``chunk``
    None, ``gdn_decode``, on the chip being traced for: of ``head_blocks(...)``, the largest
    <= ``MAX_HEAD_BLOCK`` (2 for prefill, 8 for decode) whose VMEM bound fits
    ``vmem.tile_budget()``; failing that the smallest valid block that fits; else ValueError."""
    H, Dk, Dv = num_heads, head_k_dim, head_v_dim
    budget = vmem.tile_budget()

    def need(hb: int) -> int:
        if chunk is None:
            return decode_vmem_bytes(hb, Dk, Dv, dtype)
        return ragged_vmem_bytes(hb, chunk, Dk, Dv, dtype)

    valid = head_blocks(H, Dk, Dv)
    fits = [hb for hb in valid if need(hb) <= budget]
    if not fits:
        kernel = "gdn_decode" if chunk is None else f"gdn_ragged with chunk={chunk}"
        raise ValueError(
            f"{kernel}: no head block of num_heads={H} (head_k_dim={Dk}, head_v_dim={Dv}, "
            f"{jnp.dtype(dtype).name}) fits the {budget >> 20} MiB VMEM tile budget; the "
            f"smallest, {valid[-1]}, needs {need(valid[-1]) >> 20} MiB"
        )
    most = MAX_HEAD_BLOCK["decode" if chunk is None else "ragged"]
    return next((hb for hb in fits if hb <= most), fits[-1])


def check_shapes(num_heads: int, head_k_dim: int, head_v_dim: int, dtype, chunk: int = 64) -> tuple[int, int]:
    """Refuse, up front and naming the value, a per-shard GDN config the kernels cannot compile
    for the chip being traced for (or run on); else return the (``gdn_ragged``,
    ``gdn_decode``) head blocks. Per shard: ``num_heads`` = value heads / tp (q and k come
    repeated to the value heads); ``dtype`` of q, k and v.

    Rules: ``chunk`` is a positive multiple of 8 (whole sublane tiles of a token block); the
    head dims are multiples of 8 (a
    state [Dk, Dv] in whole sublane tiles); some head block fits the VMEM tile budget."""
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"chunk={chunk} must be a positive multiple of 8 (TPU sublanes)")
    for name, d in (("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if d <= 0 or d % 8:
            raise ValueError(f"{name}={d} must be a positive multiple of 8 (TPU sublanes)")
    args = (num_heads, head_k_dim, head_v_dim, dtype)
    return pick_head_block(*args, chunk=chunk), pick_head_block(*args)


def ut_inverse_levels(chunk: int) -> int:
    return max(chunk - 1, 0).bit_length()


def ragged_cost(
    num_rows: int, num_seqs: int, num_slots: int, H: int, Dk: int, Dv: int, HB: int, chunk: int, dtype
) -> pl.CostEstimate:
    """A static upper bound on ``gdn_ragged``'s work over ``num_rows`` (padded) rows.

    Segments <= token blocks + sequences, each a whole chunk of work: per head k k^T and
    q k^T (2 Q^2 Dk each), the UT inverse (2 matmuls of Q^3 per level), u and w (2 Q^2 Dv,
    2 Q^2 Dk), the state read twice and written once (6 Q Dk Dv), the chunk's attention
    applied to v_new (2 Q^2 Dv); per head block the two cumsum matmuls (4 Q^2 HB). Bytes:
    q, k, v, g, beta once, o written once, the state pool read and written once per
    sequence (<= num_slots)."""
    Q, T = chunk, num_rows
    segments = T // Q + num_seqs
    per_head = 6 * Q * Q * Dk + 4 * Q * Q * Dv + 4 * Q**3 * ut_inverse_levels(Q) + 6 * Q * Dk * Dv
    flops = segments * (H * per_head + 4 * Q * Q * H)
    isz = jnp.dtype(dtype).itemsize
    state_bytes = 2 * min(num_seqs, num_slots) * H * Dk * Dv * 4
    io = T * H * ((2 * Dk + Dv) * isz + Dv * 4 + 2 * 4)
    return pl.CostEstimate(
        flops=flops, transcendentals=segments * H * (Q * Q + 2 * Q + 1), bytes_accessed=io + state_bytes
    )


def decode_cost(S: int, H: int, Dk: int, Dv: int, dtype) -> pl.CostEstimate:
    """``gdn_decode``'s work, an upper bound (all S sequences live, each reading and writing
    its slot): per sequence and head the decay (Dk Dv), k @ S (2 Dk Dv), the rank-one update
    (2 Dk Dv) and q @ S (2 Dk Dv), one exp; bytes are the state pool's (read + write, f32)
    plus the tokens."""
    isz = jnp.dtype(dtype).itemsize
    io = S * H * ((2 * Dk + Dv) * isz + Dv * 4 + 2 * 4)
    return pl.CostEstimate(
        flops=S * H * 7 * Dk * Dv, transcendentals=S * H, bytes_accessed=io + 2 * S * H * Dk * Dv * 4
    )


def _check(states: jax.Array, head_block: int, H: int, chunk: int | None = None) -> None:
    if states.dtype != F32:
        raise ValueError(f"the state pool must be float32 (got {states.dtype})")
    if H % head_block:
        raise ValueError(f"num_heads={H} must divide by head_block={head_block}")
    if chunk is not None and chunk % 8:
        raise ValueError(f"chunk={chunk} must be a multiple of 8 (TPU sublanes)")


# --------------------------------------------------------------------------- prefill


def _ut_inverse(L: jax.Array) -> jax.Array:
    """``(I + L)^-1`` for strictly lower-triangular ``L`` [Q, Q]: ``chunked.ut_inverse`` (the
    recursive block inverse by doubling) with 2-D matmuls, always at f32 (HIGHEST): the
    system is where the chunked form's rounding matters."""
    Q = L.shape[0]
    i, j = lax.broadcasted_iota(jnp.int32, (Q, Q), 0), lax.broadcasted_iota(jnp.int32, (Q, Q), 1)
    T = (i == j).astype(F32)
    b = 1
    while b < Q:
        high = ~(2 * b - 1)
        quadrant = ((i & high) == (j & high)) & ((i & b) != 0) & ((j & b) == 0)
        TL = _dot(T, jnp.where(quadrant, L, 0.0), (1, 0), HIGHEST)
        T = T - _dot(TL, T, (1, 0), HIGHEST)
        b *= 2
    return T


def _segment(lo, hi, blocks, o_ref, h_scr, *, precision) -> None:
    """One chunk of the recurrence for the rows [lo, hi) of this block, state in ``h_scr``
    [HB, Dk, Dv] (a ``segment_scan.Segment``); o_ref [Q, HB*Dv]."""
    # q and k [Q, HB*Dk], v [Q, HB*Dv], g and beta [Q, HB]
    q_ref, k_ref, v_ref, g_ref, beta_ref = blocks
    Q = q_ref.shape[0]
    HB, Dk, Dv = h_scr.shape
    rows = lax.broadcasted_iota(jnp.int32, (Q, 1), 0)
    mask = (rows >= lo) & (rows < hi)  # [Q, 1]
    i, j = lax.broadcasted_iota(jnp.int32, (Q, Q), 0), lax.broadcasted_iota(jnp.int32, (Q, Q), 1)
    causal, strict = i >= j, i > j  # [Qi, Qj]
    g = jnp.where(mask, g_ref[...], 0.0)  # [Q, HB], <= 0
    beta = jnp.where(mask, beta_ref[...], 0.0)  # [Q, HB]
    # The cumulative sum as a matmul with a triangle of ones, and its transpose as a product
    # with the identity (exact at HIGHEST), so exp(cum_i - cum_i) is exactly 1 (see the SSD
    # kernel's _segment).
    cum = _dot(causal.astype(F32), g, (1, 0), HIGHEST)  # [Q, HB]
    cum_t = _dot(cum, (i == j).astype(F32), (0, 0), HIGHEST)  # [HB, Q]
    for h in range(HB):  # static: a handful of heads, each a few [Q, *] matmuls
        qh = jnp.where(mask, q_ref[:, h * Dk : (h + 1) * Dk].astype(F32), 0.0)  # [Q, Dk]
        kh = jnp.where(mask, k_ref[:, h * Dk : (h + 1) * Dk].astype(F32), 0.0)  # [Q, Dk]
        vh = jnp.where(mask, v_ref[:, h * Dv : (h + 1) * Dv].astype(F32), 0.0)  # [Q, Dv]
        bh, ci = beta[:, h : h + 1], cum[:, h : h + 1]  # [Q, 1]
        c_end = cum[Q - 1 :, h : h + 1]  # [1, 1]; masked rows after hi add 0, so = cum[hi-1]
        decay = jnp.exp(jnp.where(causal, ci - cum_t[h : h + 1, :], -jnp.inf))  # [Qi, Qj]
        kb = kh * bh  # [Q, Dk]
        L = jnp.where(strict, _dot(kb, kh, (1, 1), precision) * decay, 0.0)  # [Q, Q]
        T = _ut_inverse(L)
        u = _dot(T, vh * bh, (1, 0), precision)  # [Q, Dv]
        w = _dot(T, kb * jnp.exp(ci), (1, 0), precision)  # [Q, Dk]
        state = h_scr[h]  # [Dk, Dv] state before the segment
        v_new = u - _dot(w, state, (1, 0), precision)  # [Q, Dv]
        attn = _dot(qh, kh, (1, 1), precision) * decay  # [Qi, Qj], 0 above the diagonal
        o = jnp.exp(ci) * _dot(qh, state, (1, 0), precision) + _dot(attn, v_new, (1, 0), precision)
        o_ref[:, h * Dv : (h + 1) * Dv] += o  # [Q, Dv]
        k_end = kh * jnp.exp(c_end - ci)  # [Q, Dk]
        h_scr[h] = jnp.exp(c_end) * state + _dot(k_end, v_new, (0, 0), precision)  # [Dk, Dv]


@functools.partial(jax.jit, static_argnames=("chunk", "head_block", "precision", "interpret"))
def gdn_ragged(
    q: jax.Array,  # [T, H, Dk] l2-normalised, scaled by Dk ** -0.5
    k: jax.Array,  # [T, H, Dk] l2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H] log-decay, <= 0
    beta: jax.Array,  # [T, H]
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    states: jax.Array,  # [num_slots, H, Dk, Dv] float32
    slots: jax.Array,  # [S] int32, -1: none
    has_initial_state: jax.Array,  # [S] bool
    *,
    chunk: int = 64,
    head_block: int | None = None,
    precision: lax.Precision = HIGHEST,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # o [T, H, Dv] float32, updated states
    """Ragged, slot-indexed chunked Gated DeltaNet (prefill and mixed batches).

    ``chunk``: rows per token block (a multiple of 8; 64 as in transformers and FLA).
    ``precision`` of the data matmuls: HIGHEST matches the references to f32 rounding;
    DEFAULT (one bf16 pass) is faster on TPU (the UT inverse stays at HIGHEST). Live
    sequences must own distinct slots."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    Q = chunk
    HB = head_block or pick_head_block(H, Dk, Dv, q.dtype, chunk)
    _check(states, HB, H, chunk)
    q, k, v, g, beta = segment_scan.pad_rows(Q, q, k, v, g, beta)
    Tp = q.shape[0]
    scalars = segment_scan.prefetch_scalars(
        cu_seqlens, num_seqs, slots, has_initial_state, num_rows=Tp, chunk=Q
    )
    rb = segment_scan.row_block
    qk_spec = pl.BlockSpec((Q, HB * Dk), lambda hb, b, cu, meta, *_: (rb(b, meta), hb))
    v_spec = pl.BlockSpec((Q, HB * Dv), lambda hb, b, cu, meta, *_: (rb(b, meta), hb))
    head_spec = pl.BlockSpec((None, Q, HB), lambda hb, b, cu, meta, *_: (hb, rb(b, meta), 0))
    blocks = [  # (operand, its block spec), in _segment's order
        (q.reshape(Tp, H * Dk), qk_spec),  # q [Tp, H*Dk]
        (k.reshape(Tp, H * Dk), qk_spec),  # k [Tp, H*Dk]
        (v.reshape(Tp, H * Dv), v_spec),  # v [Tp, H*Dv]
        (_head_major(g.astype(F32), HB), head_spec),  # g [H/HB, Tp, HB]
        (_head_major(beta.astype(F32), HB), head_spec),  # beta [H/HB, Tp, HB]
    ]
    o, states = segment_scan.ragged_scan(
        functools.partial(_segment, precision=precision),
        scalars,
        blocks,
        states,
        chunk=Q,
        head_block=HB,
        out_dim=Dv,
        cost=ragged_cost(Tp, cu_seqlens.shape[0] - 1, states.shape[0], H, Dk, Dv, HB, Q, q.dtype),
        interpret=interpret,
    )
    return o[:T].reshape(T, H, Dv), states
