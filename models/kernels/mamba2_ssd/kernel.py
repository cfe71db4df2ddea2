"""Mamba2 SSD as Pallas TPU kernels: ragged chunked prefill (``ssd_ragged``, here) and the
one-token decode update (``ssd_decode``, in ``decode_kernel.py``). Both read each
sequence's initial state from its slot in the state pool and write the final state back
to that slot inside the kernel; the pool is aliased input -> output, so under a jit that
donates it the update is in place.

Prefill walks the flat batch in token blocks of ``chunk`` rows, a block's *segments* (sequence
∩ block) in order, carrying each sequence's state across blocks: ``segment_scan``, shared with
the Gated DeltaNet kernel, holds the walk; this module the chunk of the scan per segment.

Within a segment, rows outside it are masked to ``dt = 0, x = B = C = 0``: they neither decay
nor add to the state and their y is 0, so every segment is a plain chunk of the SSD scan
(the quadratic form of ``chunked.py`` plus the carried state). Masking with ``where`` also
keeps NaN in padding rows out of the results.

Layouts, chosen so every block meets the TPU (8, 128) tiling whatever P, N and HB are:
x and y [T, H*P] (a free reshape; a head is a static lane slice), B and C [G, T, N] and dt
[H/HB, T, HB] (transposes that fuse into their producer under jit; B, C and dt are small next
to x). ``HB`` heads per block either lie in one group or cover ``GB`` whole groups.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hicache_jax.models.kernels import segment_scan, vmem

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def _dot(a, b, contract: tuple[int, int], precision) -> jax.Array:
    """2-D matmul contracting ``a``'s dim ``contract[0]`` with ``b``'s dim ``contract[1]``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


MAX_HEAD_BLOCK = 8  # heads are unrolled in the kernel body; more grows code and compile time


def _tiled_bytes(shape: tuple[int, ...], dtype) -> int:
    """VMEM bytes of a buffer: its last two dims pad to the (sublanes, 128 lanes) tile, where a
    sublane packs 32 bits (8 rows of f32, 16 of bf16)."""
    itemsize = jnp.dtype(dtype).itemsize
    *lead, rows, cols = (1, 1, *shape)
    pad = lambda n, m: -(-n // m) * m
    return math.prod(lead) * pad(rows, 32 // itemsize) * pad(cols, 128) * itemsize


def ragged_vmem_bytes(head_block: int, groups_per_block: int, chunk: int, P: int, N: int, dtype) -> int:
    """Upper bound on ``ssd_ragged``'s VMEM: double-buffered x/dt/A/B/C/D/y blocks, the
    [HB, P, N] state scratch and the values of the segment body. Mosaic keeps about one [Q, Q]
    and four [Q, P] f32 values per unrolled head live, plus the shared [Q, Q] masks and
    cumsum operands and each group's B, C; the coefficients bound what compiling for v5e at
    the limit needed (19 shapes: chunk 64-256, head dim 32-256, 2-8 heads; 1.7-18.6 MiB)
    by 11-48%."""
    Q, HB, GB = chunk, head_block, groups_per_block
    blocks = _tiled_bytes((Q, HB * P), dtype) + _tiled_bytes((Q, HB * P), F32)  # x, y
    blocks += _tiled_bytes((Q, HB), F32) + 2 * _tiled_bytes((1, HB), F32)  # dt, A, D
    blocks += 2 * _tiled_bytes((GB, Q, N), dtype)  # B, C
    state = _tiled_bytes((HB, P, N), F32)
    qq, qp, qn = 4 * Q * Q, 4 * Q * P, 4 * Q * N  # f32 values
    values = HB * (qq + 4 * qp) + 8 * qq + 2 * GB * qn + (1 << 20)
    return 2 * blocks + state + values


def decode_vmem_bytes(head_block: int, groups_per_block: int, P: int, N: int, dtype) -> int:
    """Upper bound on ``ssd_decode``'s VMEM: the double-buffered blocks (one token row, the
    state read), the two write-back buffers and the head loop's [P, N] values (together
    about one state block). Compiling for v5e at the limit needed 0.3-4.8 MiB (6 shapes);
    this is 21-44% over from 2 MiB up, a few times over below (the fixed 0.5 MiB)."""
    HB, GB = head_block, groups_per_block
    state = _tiled_bytes((HB, P, N), F32)
    blocks = _tiled_bytes((1, HB * P), dtype) + _tiled_bytes((1, HB * P), F32)  # x, y
    blocks += 3 * _tiled_bytes((1, HB), F32) + 2 * _tiled_bytes((GB, 1, N), dtype)  # dt A D B C
    return 2 * (blocks + state) + 2 * state + state + (512 << 10)


def head_blocks(num_heads: int, num_groups: int, head_dim: int) -> list[int]:
    """Head blocks the kernels accept, largest first: they divide H, lie in one group or cover
    whole groups, and span whole 128-lane tiles of x (or are all heads, a whole dim)."""
    H, hpg = num_heads, num_heads // num_groups
    return [
        hb
        for hb in range(H, 0, -1)
        if H % hb == 0 and (hpg % hb == 0 or hb % hpg == 0) and ((hb * head_dim) % 128 == 0 or hb == H)
    ]


def pick_head_block(
    num_heads: int, num_groups: int, head_dim: int, state_size: int, dtype, chunk: int | None = None
) -> int:
    """The head block for ``ssd_ragged`` (``chunk`` rows per token block) or, with ``chunk``
    None, ``ssd_decode``, on the chip being traced for.

    Rule: of ``head_blocks(...)``, the largest <= ``MAX_HEAD_BLOCK`` whose VMEM bound
    (``ragged_vmem_bytes`` / ``decode_vmem_bytes``) fits ``vmem.tile_budget()``; failing that
    the smallest valid block that fits (all heads, when no smaller block spans whole lane
    tiles); else ValueError. So v5p (12 MiB of tiles) takes a smaller block than v5e and v6e
    (24 MiB) at head dim 256 with chunk 256; off TPU the budget is v5p's."""
    H, G, P, N = num_heads, num_groups, head_dim, state_size
    if H % G:
        raise ValueError(f"num_heads={H} must divide by num_groups={G}")
    budget = vmem.tile_budget()

    def need(hb: int) -> int:
        gb = max(1, hb // (H // G))
        if chunk is None:
            return decode_vmem_bytes(hb, gb, P, N, dtype)
        return ragged_vmem_bytes(hb, gb, chunk, P, N, dtype)

    fits = [hb for hb in head_blocks(H, G, P) if need(hb) <= budget]
    if not fits:
        smallest = head_blocks(H, G, P)[-1]
        kernel = "ssd_decode" if chunk is None else f"ssd_ragged with chunk={chunk}"
        raise ValueError(
            f"{kernel}: no head block of num_heads={H} (num_groups={G}, head_dim={P}, "
            f"state_size={N}, {jnp.dtype(dtype).name}) fits the {budget >> 20} MiB VMEM tile "
            f"budget; the smallest, {smallest}, needs {need(smallest) >> 20} MiB"
        )
    return next((hb for hb in fits if hb <= MAX_HEAD_BLOCK), fits[-1])


def check_shapes(
    num_heads: int, num_groups: int, head_dim: int, state_size: int, dtype, chunk: int = 128
) -> tuple[int, int]:
    """Refuse, up front and naming the value, a per-shard Mamba2 config the kernels cannot
    compile for the chip being traced for (or run on); else return the (``ssd_ragged``,
    ``ssd_decode``) head blocks. Per shard: ``num_heads`` / tp heads and the groups each
    shard sees (``sharded.ssd`` repeats G < tp to one per shard); ``dtype`` of x, B and C.

    Rules: H divides by G; ``chunk`` is a positive multiple of 8 (whole sublane tiles of a
    token block); some head block fits the VMEM tile budget (``pick_head_block``)."""
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"chunk={chunk} must be a positive multiple of 8 (TPU sublanes)")
    args = (num_heads, num_groups, head_dim, state_size, dtype)
    return pick_head_block(*args, chunk=chunk), pick_head_block(*args)


def ragged_cost(
    num_rows: int, num_seqs: int, num_slots: int, H: int, P: int, N: int, G: int, HB: int, chunk: int, dtype
) -> pl.CostEstimate:
    """A static upper bound on ``ssd_ragged``'s work over ``num_rows`` (padded) rows.

    Segments <= token blocks + sequences, each a whole chunk of work: per head the [Q, Q]
    decays (exp) applied to x (2 Q^2 P) and the state in and out (4 Q P N); per group in a
    head block C.B^T (2 Q^2 N, recomputed by each head block of a group); per head block the
    two cumsum matmuls (4 Q^2 HB). Bytes: x once and B, C once per head block reading them;
    y written once; the state pool read and written once per sequence (<= num_slots)."""
    Q, T = chunk, num_rows
    segments = T // Q + num_seqs
    products = max(H // HB, G)  # B, C group blocks fetched and C.B^T formed: once per head block
    per_head = 2 * Q * Q * P + 4 * Q * P * N + 3 * Q * Q
    flops = segments * (H * per_head + products * 2 * Q * Q * N + 4 * Q * Q * H)
    isz = jnp.dtype(dtype).itemsize
    state_bytes = 2 * min(num_seqs, num_slots) * H * P * N * 4
    io = T * H * P * (isz + 4) + T * H * 4 + 2 * products * T * N * isz + 2 * H * 4
    return pl.CostEstimate(
        flops=flops, transcendentals=segments * H * (Q * Q + 2 * Q + 1), bytes_accessed=io + state_bytes
    )


def decode_cost(S: int, H: int, P: int, N: int, G: int, HB: int, dtype) -> pl.CostEstimate:
    """``ssd_decode``'s work, an upper bound (all S sequences live, each reading and writing its
    slot): per sequence and head the state update (4 P N: decay, outer product, add) and y
    (2 P N + 2 P), one exp; bytes are the state pool's (read + write, f32) plus the tokens."""
    isz = jnp.dtype(dtype).itemsize
    products = max(H // HB, G)  # B, C group blocks fetched per sequence
    io = S * H * P * (isz + 4) + S * H * 4 + 2 * S * products * N * isz + 2 * H * 4
    return pl.CostEstimate(
        flops=S * H * (6 * P * N + 2 * P), transcendentals=S * H, bytes_accessed=io + 2 * S * H * P * N * 4
    )


def _group_block(num_heads: int, num_groups: int, head_block: int) -> tuple[int, int]:
    """(groups per head block, heads per group); checks the head block is group-compatible."""
    hpg = num_heads // num_groups
    if num_heads % num_groups or num_heads % head_block:
        raise ValueError(f"H={num_heads} must divide by G={num_groups} and head_block={head_block}")
    if hpg % head_block and head_block % hpg:
        raise ValueError(f"head_block={head_block} must lie in one group or cover whole groups")
    return max(1, head_block // hpg), hpg


def _check(states: jax.Array, chunk: int | None = None) -> None:
    if states.dtype != F32:
        raise ValueError(f"the state pool must be float32 (got {states.dtype})")
    if chunk is not None and chunk % 8:
        raise ValueError(f"chunk={chunk} must be a multiple of 8 (TPU sublanes)")


def _group_blk(hb, *, head_block: int, hpg: int, groups_per_block: int):
    """Index of head block ``hb``'s groups in B, C cut into blocks of GB groups."""
    return lax.div(hb * head_block, hpg * groups_per_block)


def _group_major(v: jax.Array) -> jax.Array:
    """[T, G, N] -> [G, T, N]: a group's rows as one tile."""
    return v.transpose(1, 0, 2)


def _head_major(v: jax.Array, head_block: int) -> jax.Array:
    """[T, H] -> [H/HB, T, HB]: a head block's columns as one tile."""
    T, H = v.shape
    return v.reshape(T, H // head_block, head_block).transpose(1, 0, 2)


# --------------------------------------------------------------------------- prefill


def _segment(lo, hi, blocks, y_ref, h_scr, *, hpg: int, precision) -> None:
    """One chunk of the scan for the rows [lo, hi) of this block, state in ``h_scr`` [HB, P, N]
    (a ``segment_scan.Segment``); y_ref [Q, HB*P]."""
    # x [Q, HB*P], dt [Q, HB], A [1, HB], B and C [GB, Q, N], D [1, HB]
    x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref = blocks
    Q = x_ref.shape[0]
    HB, P, N = h_scr.shape
    rows = lax.broadcasted_iota(jnp.int32, (Q, 1), 0)
    mask = (rows >= lo) & (rows < hi)  # [Q, 1]
    i, j = lax.broadcasted_iota(jnp.int32, (Q, Q), 0), lax.broadcasted_iota(jnp.int32, (Q, Q), 1)
    causal = i >= j  # [Qi, Qj]
    dt = jnp.where(mask, dt_ref[...].astype(F32), 0.0)  # [Q, HB]
    a = dt * a_ref[...]  # [Q, HB], log-decay per row, <= 0
    # The cumulative sum as a matmul with a triangle of ones (the MXU's cumsum). Its row
    # orientation must be the *same* numbers, so that exp(cum_i - cum_i) is exactly 1: the
    # diagonal term dominates y, and two differently rounded sums of up to Q log-decays
    # would put eps * |cum| on it. A product with the identity at HIGHEST is exact (an f32 is
    # three bf16 pieces, each times 1) and avoids an in-register transpose.
    tril = causal.astype(F32)  # [Qi, Qj]
    cum = _dot(tril, a, (1, 0), HIGHEST)  # [Q, HB]
    cum_t = _dot(cum, (i == j).astype(F32), (0, 0), HIGHEST)  # [HB, Q], = cum.T exactly
    d_row = d_ref[...]  # [1, HB]
    per_group: dict[int, tuple] = {}
    for h in range(HB):  # static: a handful of heads, each a few [Q, *] matmuls
        g = h // hpg  # group within this block
        if g not in per_group:
            Bg = jnp.where(mask, b_ref[g].astype(F32), 0.0)  # [Q, N]
            Cg = jnp.where(mask, c_ref[g].astype(F32), 0.0)  # [Q, N]
            per_group[g] = (Bg, Cg, _dot(Cg, Bg, (1, 1), precision))  # CB: [Qi, Qj]
        Bg, Cg, CB = per_group[g]
        xh = jnp.where(mask, x_ref[:, h * P : (h + 1) * P].astype(F32), 0.0)  # [Q, P]
        xdt = xh * dt[:, h : h + 1]  # [Q, P]
        ci = cum[:, h : h + 1]  # [Q, 1]
        c_end = cum[Q - 1 :, h : h + 1]  # [1, 1]; masked rows after hi add 0, so = cum[hi-1]
        decay = jnp.exp(jnp.where(causal, ci - cum_t[h : h + 1, :], -jnp.inf))  # [Qi, Qj]
        state = h_scr[h]  # [P, N] state before the segment
        y = _dot(CB * decay, xdt, (1, 0), precision)  # [Q, P] within the chunk
        y = y + jnp.exp(ci) * _dot(Cg, state, (1, 1), precision)  # [Q, P] from the state
        y_ref[:, h * P : (h + 1) * P] += y + d_row[:, h : h + 1] * xh
        to_end = xdt * jnp.exp(c_end - ci)  # [Q, P]
        h_scr[h] = jnp.exp(c_end) * state + _dot(to_end, Bg, (0, 0), precision)  # [P, N]


@functools.partial(jax.jit, static_argnames=("chunk", "head_block", "precision", "interpret"))
def ssd_ragged(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H] softplus + bias already applied
    A: jax.Array,  # [H]
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    D: jax.Array,  # [H]
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    states: jax.Array,  # [num_slots, H, P, N] float32
    slots: jax.Array,  # [S] int32, -1: none
    has_initial_state: jax.Array,  # [S] bool
    *,
    chunk: int = 128,
    head_block: int | None = None,
    precision: lax.Precision = HIGHEST,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:  # y [T, H, P] float32, updated states
    """Ragged, slot-indexed chunked SSD scan (prefill and mixed batches).

    ``chunk``: rows per token block (a multiple of 8; 128 or 256 on TPU). ``precision`` of the
    data matmuls: HIGHEST matches the references to f32 rounding; DEFAULT (one bf16 pass) is
    faster on TPU. Live sequences must own distinct slots."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    Q = chunk
    _check(states, chunk)
    HB = head_block or pick_head_block(H, G, P, N, x.dtype, chunk)
    GB, hpg = _group_block(H, G, HB)
    x, dt, B, C = segment_scan.pad_rows(Q, x, dt, B, C)
    Tp = x.shape[0]
    scalars = segment_scan.prefetch_scalars(
        cu_seqlens, num_seqs, slots, has_initial_state, num_rows=Tp, chunk=Q
    )
    rb = segment_scan.row_block
    gblk = functools.partial(_group_blk, head_block=HB, hpg=hpg, groups_per_block=GB)
    row_spec = pl.BlockSpec((Q, HB * P), lambda hb, b, cu, meta, *_: (rb(b, meta), hb))
    dt_spec = pl.BlockSpec((None, Q, HB), lambda hb, b, cu, meta, *_: (hb, rb(b, meta), 0))
    group_spec = pl.BlockSpec((GB, Q, N), lambda hb, b, cu, meta, *_: (gblk(hb), rb(b, meta), 0))
    head_spec = pl.BlockSpec((None, 1, HB), lambda hb, b, *_: (hb, 0, 0))
    blocks = [  # (operand, its block spec), in _segment's order
        (x.reshape(Tp, H * P), row_spec),  # x [Tp, H*P]
        (_head_major(dt.astype(F32), HB), dt_spec),  # dt [H/HB, Tp, HB]
        (_head_major(A.astype(F32)[None], HB), head_spec),  # A [H/HB, 1, HB]
        (_group_major(B), group_spec),  # B [G, Tp, N]
        (_group_major(C), group_spec),  # C [G, Tp, N]
        (_head_major(D.astype(F32)[None], HB), head_spec),  # D [H/HB, 1, HB]
    ]
    y, states = segment_scan.ragged_scan(
        functools.partial(_segment, hpg=hpg, precision=precision),
        scalars,
        blocks,
        states,
        chunk=Q,
        head_block=HB,
        out_dim=P,
        cost=ragged_cost(Tp, cu_seqlens.shape[0] - 1, states.shape[0], H, P, N, G, HB, Q, x.dtype),
        interpret=interpret,
    )
    return y[:T].reshape(T, H, P), states
