"""The state trail of a verify step (``ForwardBatch.state_trail``): a recurrent layer's
state after each token of a sequence's chunk, written to scratch slots so the engine can
roll back to any accepted draft token without running it again.

The chunk runs as ``Q`` one-token updates, the j-th on each sequence's j-th token (the
decode recurrence), and the state after update j goes to the sequence's trail slot j::

    rows        | s0: t0 t1 t2 t3 | s1: t0 t1 | s2: t0 | (s3: 0 tokens)
    update j=0  |     t0          |     t0    |     t0 |   nothing read or written
    update j=1  |        t1       |        t1 |        |
    ...
    after j     state -> trail[s, j]   (where j < q_len[s] and trail[s, j] >= 0)
    at the end  state -> the working slot, as in any step

``xla`` (``trail_reference``) gathers each sequence's state once, carries it through the Q
updates and scatters it to each trail slot and the working slot: one read, q_len + 1
writes. ``pallas`` runs the backend's decode kernel Q times on the working slot and copies
the working slot to trail slot j after update j (``trail_by_decode``): each update reads
and writes the state once, each copy once more. Both run per shard under tensor
parallelism, as the ordinary kernels do (``sharded.py``). The conv state after token j is a
window of the carried state and the chunk's conv inputs, gathered directly
(``conv_trail``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.kernels import backend, sharded
from hicache_jax.models.kernels.gated_delta_rule.reference import gdn_decode_step
from hicache_jax.models.kernels.mamba2_ssd.chunked import gather_states, scatter_states
from hicache_jax.models.kernels.mamba2_ssd.reference import ssd_decode_step


@dataclasses.dataclass(frozen=True)
class Recurrence:
    """A recurrent kernel kind: its slot-indexed kernels, their split over tensor
    parallelism, its one-token step and which of its operands have a row per token."""

    # (backend, interpret, decode) -> fn(*operands, cu_seqlens, num_seqs, states, slots, init)
    kernel: Callable[..., Callable]
    per_shard: Callable[..., Callable]  # (fn, mesh) -> fn per shard
    # (state [S, ...], *operands with one row per sequence) -> (out, new state)
    step: Callable[..., tuple[jax.Array, jax.Array]]
    per_token: tuple[bool, ...]


KINDS = {
    "ssd": Recurrence(  # x, dt, A, B, C, D
        backend.ssd_fn, sharded.ssd, ssd_decode_step, (True, True, False, True, True, False)
    ),
    "gdn": Recurrence(backend.gdn_fn, sharded.gdn, gdn_decode_step, (True,) * 5),  # q, k, v, g, beta
}

# update(take, cu_seqlens, states, slots, has_initial_state) -> (y [S, ...], states): one
# decode update of a sub-batch holding one token per sequence, at row s of the per-token
# operands the layer passes through ``take`` (which gathers [T, ...] -> [S, ...]).
Update = Callable[..., tuple[jax.Array, jax.Array]]


def q_lens_of(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """[S] tokens per sequence; 0 for padding sequences (whose cu entries may hold junk)."""
    S = cu_q_lens.shape[0] - 1
    return jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)


def copy_slots(states: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """``states[dst[i]] = states[src[i]]`` where ``dst[i] >= 0`` (``src`` valid there)."""
    N = states.shape[0]
    rows = states[jnp.clip(src, 0, N - 1)]
    return states.at[jnp.where(dst >= 0, dst, N)].set(rows, mode="drop")


def recurrence(
    kind: str,  # a key of KINDS
    kernels,  # KernelConfig
    operands: Sequence[jax.Array],  # the kernel's operands before ``cu_seqlens``
    states: jax.Array,  # [num_slots, H, ...] the layer's recurrence states
    batch: ForwardBatch,
) -> tuple[jax.Array, jax.Array]:  # out [T, H, ...] float32, updated states
    """A recurrent layer's scan over the step: the backend's kernel as usual, or, in a verify
    step, token by token with the trail written."""
    r, b = KINDS[kind], batch
    name, mesh = kernels.ssd_backend, kernels.mesh
    slots, init = b.state_slots, b.has_initial_state
    if b.state_trail is None:
        fn = r.per_shard(r.kernel(name, kernels.interpret, b.decode_only), mesh)
        return fn(*operands, b.cu_q_lens, b.num_seqs, states, slots, init)
    if name == "xla":
        fn = r.per_shard(functools.partial(trail_reference, r.step, r.per_token), mesh)
        # The trail rides with the working slots: the kernels' slots operand is replicated.
        with_trail = jnp.concatenate([slots[:, None], b.state_trail], axis=1).astype(jnp.int32)
        return fn(*operands, b.cu_q_lens, b.num_seqs, states, with_trail, init)
    step = r.per_shard(r.kernel(name, kernels.interpret, True), mesh)

    def update(take, cu, states, slots, init):  # one token of each sequence
        ops = [take(a) if t else a for a, t in zip(operands, r.per_token, strict=True)]
        return step(*ops, cu, b.num_seqs, states, slots, init)

    T = b.input_ids.shape[0]
    return trail_by_decode(update, states, b.cu_q_lens, b.num_seqs, slots, init, b.state_trail, num_rows=T)


def trail_reference(
    step: Callable[..., tuple[jax.Array, jax.Array]],  # Recurrence.step
    per_token: Sequence[bool],
    *args: jax.Array,  # *operands, cu_seqlens [S+1], num_seqs, states, slots_trail [S, 1+Q], init [S]
) -> tuple[jax.Array, jax.Array]:  # out [T, H, ...] float32, updated states
    """A verify chunk in plain JAX, with the slot kernels' signature but ``slots`` [S, 1 + Q]:
    each sequence's working slot, then its trail. Each state is read once."""
    *operands, cu, num_seqs, states, slots_trail, init = args
    slots, trail = slots_trail[:, 0], slots_trail[:, 1:]
    S, Q = trail.shape
    N = states.shape[0]
    T = operands[list(per_token).index(True)].shape[0]
    h, live = gather_states(states, slots, init, num_seqs)  # [S, H, ...] zeros where fresh
    q_lens = q_lens_of(cu, num_seqs)
    out = None
    for j in range(Q):
        valid = j < q_lens  # [S]
        rows = jnp.clip(cu[:-1] + j, 0, T - 1)  # [S] each sequence's j-th token
        out_j, new = step(h, *(a[rows] if t else a for a, t in zip(operands, per_token, strict=True)))
        h = jnp.where(valid.reshape((S,) + (1,) * (h.ndim - 1)), new, h)
        if out is None:
            out = jnp.zeros((T,) + out_j.shape[1:], jnp.float32)
        out = out.at[jnp.where(valid, rows, T)].set(out_j.astype(jnp.float32), mode="drop")
        dst = jnp.where(valid & (trail[:, j] >= 0), trail[:, j], N)
        states = states.at[dst].set(new.astype(states.dtype), mode="drop")
    return out, scatter_states(states, slots, live, h)


def trail_by_decode(
    update: Update,
    states: jax.Array,  # [num_slots, H, ...] float32: the layer's recurrence states
    cu_q_lens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # []
    slots: jax.Array,  # [S] working slots
    has_initial_state: jax.Array,  # [S] bool
    trail: jax.Array,  # [S, Q] int32 trail slots (-1: none)
    *,
    num_rows: int,
) -> tuple[jax.Array, jax.Array]:  # y [num_rows, H, ...] float32, updated states
    """Run a verify chunk token by token, leaving each working slot at the state after its
    sequence's last token and trail slot ``trail[s, j]`` at the state after token j."""
    S, Q = trail.shape
    T = num_rows
    q_lens = q_lens_of(cu_q_lens, num_seqs)
    live = (jnp.arange(S) < num_seqs) & (slots >= 0)
    # As the ordinary path: a fresh sequence with no tokens leaves its slot at zeros.
    empty = live & ~has_initial_state & (q_lens == 0)
    states = states.at[jnp.where(empty, slots, states.shape[0])].set(0.0, mode="drop")
    one_each = jnp.arange(S + 1, dtype=jnp.int32)  # sub-batch: sequence s's token at row s
    y = None
    for j in range(Q):
        valid = j < q_lens  # [S]
        rows = jnp.clip(cu_q_lens[:-1] + j, 0, T - 1)  # [S] each sequence's j-th token
        slots_j = jnp.where(valid, slots, -1).astype(jnp.int32)
        # After update 0 the working slot holds the state after the first token.
        init_j = has_initial_state if j == 0 else jnp.ones_like(has_initial_state)
        y_j, states = update(lambda a, rows=rows: a[rows], one_each, states, slots_j, init_j)
        if y is None:
            y = jnp.zeros((T,) + y_j.shape[1:], jnp.float32)
        y = y.at[jnp.where(valid, rows, T)].set(y_j.astype(jnp.float32), mode="drop")
        states = copy_slots(states, slots_j, jnp.where(slots_j >= 0, trail[:, j], -1))
    return y, states


def conv_trail(
    conv: jax.Array,  # [num_slots, K - 1, C] the layer's conv state pool
    conv0: jax.Array,  # [S, K - 1, C] each sequence's carried conv inputs (zeros when fresh)
    x: jax.Array,  # [T, C] the step's conv inputs
    batch: ForwardBatch,
) -> jax.Array:
    """``conv`` with ``state_trail[s, j]`` set to the last K - 1 conv inputs up to token j
    (``conv`` itself in an ordinary step)::

    window   | conv0[s]: K-1 rows | x[cu[s]] ... x[cu[s] + Q - 1] |
    trail j  |          <-- rows j+1 .. j+K-1 of the window -->
    """
    trail, cu_q_lens = batch.state_trail, batch.cu_q_lens
    if trail is None:
        return conv
    S, Q = trail.shape
    T, K1 = x.shape[0], conv0.shape[1]
    rows = jnp.clip(cu_q_lens[:-1, None] + jnp.arange(Q)[None, :], 0, T - 1)  # [S, Q]
    window = jnp.concatenate([conv0.astype(conv.dtype), x[rows].astype(conv.dtype)], axis=1)
    idx = jnp.arange(Q)[:, None] + 1 + jnp.arange(K1)[None, :]  # [Q, K-1]
    after = window[:, idx]  # [S, Q, K-1, C]
    valid = (jnp.arange(Q)[None, :] < q_lens_of(cu_q_lens, batch.num_seqs)[:, None]) & (trail >= 0)
    dst = jnp.where(valid, trail, conv.shape[0]).reshape(S * Q)
    return conv.at[dst].set(after.reshape((S * Q,) + after.shape[2:]), mode="drop")
