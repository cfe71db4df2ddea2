"""The state trail of a verify step (``ForwardBatch.state_trail``): a recurrent layer's
state after each token of a sequence's chunk, written to scratch slots so the engine can
roll back to any accepted draft token without running it again.

The chunk runs as ``Q`` one-token decode updates, the j-th on each sequence's j-th token,
through the backend's own decode kernel (so ``xla``, ``pallas`` and tensor parallelism work
as for decode); after update j the working slot holds the state after token j and is
copied to the sequence's trail slot j::

    rows        | s0: t0 t1 t2 t3 | s1: t0 t1 | s2: t0 | (s3: 0 tokens)
    update j=0  |     t0          |     t0    |     t0 |   slot -1: reads, writes nothing
    update j=1  |        t1       |        t1 |        |
    ...
    after j     working slot -> trail[s, j]   (where j < q_len[s] and trail[s, j] >= 0)

Each update reads and writes the sequence's state once (the decode kernels' bound), and the
copy reads and writes it once more. The conv state after token j is a window of the
carried state and the chunk's conv inputs, gathered directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from hicache_jax.models.batch import ForwardBatch

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
    kernel: Callable[[bool], Callable],  # decode -> the backend's slot-indexed fn, per shard
    operands: Sequence[jax.Array],  # the fn's operands before ``cu_seqlens``
    per_token: Sequence[bool],  # which operands have a row per token ([T, ...])
    states: jax.Array,  # [num_slots, H, ...] the layer's recurrence states
    batch: ForwardBatch,
) -> tuple[jax.Array, jax.Array]:  # out [T, H, ...] float32, updated states
    """A recurrent layer's scan over the step: the backend's kernel (``backend.ssd_fn``,
    ``gdn_fn``) as usual, or, in a verify step, token by token with the trail written."""
    b = batch
    if b.state_trail is None:
        fn = kernel(b.decode_only)
        return fn(*operands, b.cu_q_lens, b.num_seqs, states, b.state_slots, b.has_initial_state)
    step = kernel(True)

    def update(take, cu, states, slots, init):  # one token of each sequence
        ops = [take(a) if t else a for a, t in zip(operands, per_token, strict=True)]
        return step(*ops, cu, b.num_seqs, states, slots, init)

    return recurrent_trail(
        update,
        states,
        b.cu_q_lens,
        b.num_seqs,
        b.state_slots,
        b.has_initial_state,
        b.state_trail,
        num_rows=b.input_ids.shape[0],
    )


def recurrent_trail(
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
