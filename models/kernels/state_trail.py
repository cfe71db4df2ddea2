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

Each state is read once and written once per named slot: ``xla`` (``trail_reference``)
gathers each sequence's state, carries it through the Q steps and scatters it to each trail
slot and at the end to the working slot; ``pallas`` (``trail_kernel.py``) runs the decode
kernels' step over the tokens in VMEM, writing each state out by DMA. Both run per shard
under tensor parallelism as the ordinary kernels do (``sharded.py``; the trail rides in
the replicated slots operand). The conv state after token j is a window of the carried
state and the chunk's conv inputs, gathered directly (``conv_trail``).
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
    pallas_trail: str  # its verify kernel in ``trail_kernel.py``

    def trail(self, backend_name: str, interpret: bool) -> Callable:
        """The verify chunk with the slot kernels' signature, ``slots`` [S, 1 + Q]."""
        if backend_name == "xla":
            return functools.partial(trail_reference, self.step, self.per_token)
        from hicache_jax.models.kernels import trail_kernel  # TPU code: imported when used

        return functools.partial(getattr(trail_kernel, self.pallas_trail), interpret=interpret)


KINDS = {
    "ssd": Recurrence(  # x, dt, A, B, C, D
        backend.ssd_fn, sharded.ssd, ssd_decode_step, (True, True, False, True, True, False), "ssd_trail"
    ),
    "gdn": Recurrence(  # q, k, v, g, beta
        backend.gdn_fn, sharded.gdn, gdn_decode_step, (True,) * 5, "gdn_trail"
    ),
}


def q_lens_of(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """[S] tokens per sequence; 0 for padding sequences (whose cu entries may hold junk)."""
    S = cu_q_lens.shape[0] - 1
    return jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)


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
    fn = r.per_shard(r.trail(name, kernels.interpret), mesh)
    # The trail rides with the working slots: the kernels' slots operand is replicated.
    with_trail = jnp.concatenate([slots[:, None], b.state_trail], axis=1).astype(jnp.int32)
    return fn(*operands, b.cu_q_lens, b.num_seqs, states, with_trail, init)


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
