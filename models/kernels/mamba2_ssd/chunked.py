"""Mamba2 SSD as a chunked scan in plain JAX: the ``xla`` backend for ragged prefill.

Each sequence's tokens are laid out from a chunk boundary, so no chunk mixes sequences::

    flat rows   | s0: 40 tokens            | s1: 3 | s2: 20      |
    chunks(Q=16)| c0 16 | c1 16 | c2 8+pad | c3 3+pad | c4 16 | c5 4+pad |

Padding rows have ``dt = 0``: they neither decay nor add to the state. Within a chunk the
output is an attention-like product with decays ``exp(cum_i - cum_j)``; across chunks a
``lax.scan`` carries the state, restarting from the sequence's initial state at its
first chunk. The result equals the sequential recurrence (``reference.ssd_sequential``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hicache_jax.models.kernels.chunk_layout import chunk_layout
from hicache_jax.models.kernels.mamba2_ssd.reference import expand_groups


@functools.partial(jax.jit, static_argnames=("chunk",))
def ssd_chunked(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    D: jax.Array,  # [H]
    cu_seqlens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    init_states: jax.Array,  # [S, H, P, N]
    *,
    chunk: int = 32,
) -> tuple[jax.Array, jax.Array]:  # y [T, H, P], final states [S, H, P, N]
    T, H, P = x.shape
    N = B.shape[-1]
    Q = chunk
    f32 = jnp.float32

    # Chunk-aligned layout (shared with the Gated DeltaNet's chunked form).
    dest, c_seq, c_first, last, q_lens, NC = chunk_layout(cu_seqlens, num_seqs, T, Q)
    valid = dest < NC * Q

    def lay(a):
        z = jnp.zeros((NC * Q,) + a.shape[1:], f32)
        return z.at[dest].set(a.astype(f32), mode="drop").reshape((NC, Q) + a.shape[1:])

    xc, dtc = lay(x), lay(dt)  # [NC, Q, H, P], [NC, Q, H]
    Bc, Cc = lay(expand_groups(B, H)), lay(expand_groups(C, H))  # [NC, Q, H, N]

    a = dtc * A  # [NC, Q, H], <= 0
    cum = jnp.cumsum(a, axis=1)
    xdt = xc * dtc[..., None]
    # Within a chunk: y_i += sum_{j<=i} exp(cum_i - cum_j) (C_i . B_j) xdt_j
    diff = cum[:, :, None, :] - cum[:, None, :, :]  # [NC, Qi, Qj, H]
    causal = jnp.tril(jnp.ones((Q, Q), bool))[None, :, :, None]
    decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))
    cb = jnp.einsum("cihn,cjhn->cijh", Cc, Bc)
    y = jnp.einsum("cijh,cjhp->cihp", cb * decay, xdt)
    # State each chunk adds by its end.
    to_end = jnp.exp(cum[:, -1:, :] - cum)  # [NC, Q, H]
    local = jnp.einsum("cjhn,cjh,cjhp->chpn", Bc, to_end, xdt)
    chunk_decay = jnp.exp(cum[:, -1, :])  # [NC, H]
    h0 = init_states.astype(f32)

    def step(prev, inp):
        first, s, dec, loc = inp
        incoming = jnp.where(first, h0[s], prev)
        end = dec[:, None, None] * incoming + loc
        return end, (end, incoming)

    _, (ends, incoming) = jax.lax.scan(step, jnp.zeros((H, P, N), f32), (c_first, c_seq, chunk_decay, local))
    y = y + jnp.einsum("cihn,cih,chpn->cihp", Cc, jnp.exp(cum), incoming)
    y = y + D[:, None] * xc
    y = y.reshape(NC * Q, H, P).at[jnp.minimum(dest, NC * Q - 1)].get()
    y = jnp.where(valid[:, None, None], y, 0.0)
    finals = jnp.where((q_lens > 0)[:, None, None, None], ends[last], h0)
    return y, finals


def gather_states(states, slots, has_initial_state, num_seqs):
    """Initial states per sequence from the slot pool (zero where fresh or padding)."""
    S = slots.shape[0]
    live = (jnp.arange(S) < num_seqs) & (slots >= 0)
    src = jnp.clip(slots, 0, states.shape[0] - 1)
    use = (live & has_initial_state).reshape((S,) + (1,) * (states.ndim - 1))
    return jnp.where(use, states[src], jnp.zeros((), states.dtype)), live


def scatter_states(states, slots, live, new):
    """Write per-sequence states back to their slots (padding sequences write nothing)."""
    dst = jnp.where(live, slots, states.shape[0])
    return states.at[dst].set(new.astype(states.dtype), mode="drop")


def ssd_slots(x, dt, A, B, C, D, cu_seqlens, num_seqs, states, slots, has_initial_state):
    """Slot-indexed prefill scan: read each sequence's state from ``states[slots[s]]``
    (when ``has_initial_state[s]``), scan, and write the final state back to that slot.

    states: [num_slots, H, P, N] float32 -> returns (y [T, H, P], updated states)."""
    h0, live = gather_states(states, slots, has_initial_state, num_seqs)
    y, finals = ssd_chunked(x, dt, A, B, C, D, cu_seqlens, num_seqs, h0)
    return y, scatter_states(states, slots, live, finals)


def ssd_decode_slots(x, dt, A, B, C, D, cu_seqlens, num_seqs, states, slots, has_initial_state):
    """Slot-indexed one-token update for a decode-only batch (sequence s's token at row
    ``cu_seqlens[s]``); same signature and result as ``ssd_slots``."""
    from hicache_jax.models.kernels.mamba2_ssd.reference import ssd_decode_step

    T = x.shape[0]
    S = slots.shape[0]
    h0, live = gather_states(states, slots, has_initial_state, num_seqs)
    rows = jnp.clip(cu_seqlens[:-1], 0, T - 1)
    y_seq, new = ssd_decode_step(h0, x[rows], dt[rows], A, B[rows], C[rows], D)
    dest = jnp.where(jnp.arange(S) < num_seqs, rows, T)
    y = jnp.zeros((T,) + x.shape[1:], jnp.float32).at[dest].set(y_seq, mode="drop")
    return y, scatter_states(states, slots, live, new)
