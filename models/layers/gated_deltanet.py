"""Gated DeltaNet mixer (Qwen3-Next, Qwen3.5 linear attention): in-projection, causal conv
over q, k and v, the gated delta rule, gated RMSNorm, out-projection.

The in-projection's columns are grouped by key head: each of the ``num_k_heads`` groups
holds its query and key head and the ``r = num_v_heads // num_k_heads`` value heads that
share them, then those heads' z gates, betas and decays::

    in_proj columns   | group 0                              | group 1 | ...
    one group         | q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv) | b (r) | a (r) |
    conv channels     | q k v of group 0 | q k v of group 1 | ...

so splitting the columns (and the conv channels and its state) evenly over ``tp`` devices,
with ``tp`` dividing ``num_k_heads``, gives each device whole groups: its own heads, and no
collective until ``out_proj``. Checkpoints are converted to this layout at load
(``hf/weights.py``): Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba`` are grouped the same way
already, Qwen3.5's ``in_proj_qkv``/``z``/``b``/``a`` and both families' conv are not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.cache import RecurrentState
from hicache_jax.models.config import GdnConfig, ModelConfig
from hicache_jax.models.kernels import state_trail
from hicache_jax.models.kernels.gated_delta_rule.reference import l2norm
from hicache_jax.models.kernels.mamba2_ssd.chunked import gather_states, scatter_states
from hicache_jax.models.kernels.mamba2_ssd.conv import causal_conv1d
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.norms import GatedRMSNorm


def group_width(g: GdnConfig) -> tuple[int, int]:
    """(conv channels, in_proj columns) of one key-head group."""
    r = g.num_v_heads // g.num_k_heads
    conv = 2 * g.head_k_dim + r * g.head_v_dim
    return conv, conv + r * g.head_v_dim + 2 * r


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, kernels):
        g = cfg.gdn
        self.cfg = g
        self.kernels = kernels
        _, width = group_width(g)
        self.in_proj = Linear(cfg.hidden_size, g.num_k_heads * width, bias=False, dtype=dtype, rngs=rngs)
        self.conv_weight = nnx.Param(
            (jax.random.normal(rngs.params(), (g.conv_kernel, g.conv_dim)) * 0.5).astype(dtype)
        )
        Hv = g.num_v_heads
        self.dt_bias = nnx.Param(jnp.ones((Hv,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, Hv + 1, dtype=jnp.float32)).astype(dtype))
        self.norm = GatedRMSNorm(
            g.head_v_dim, g.head_v_dim, eps=cfg.rms_norm_eps, dtype=dtype, norm_before_gate=True
        )
        self.out_proj = Linear(g.value_dim, cfg.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    @jax.named_scope("gdn")
    def __call__(
        self, st: RecurrentState, x: jax.Array, batch: ForwardBatch
    ) -> tuple[RecurrentState, jax.Array]:
        g = self.cfg
        T = x.shape[0]
        Hk, Hv, Dk, Dv = g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim
        r = Hv // Hk
        conv_w, _ = group_width(g)
        proj = self.in_proj(x).reshape(T, Hk, -1)  # [T, Hk, group]
        qkv, z, b, a = jnp.split(proj, [conv_w, conv_w + r * Dv, conv_w + r * Dv + r], axis=-1)

        conv0, live = gather_states(st.conv, batch.state_slots, batch.has_initial_state, batch.num_seqs)
        conv_in = qkv.reshape(T, g.conv_dim)
        qkv, conv_new = causal_conv1d(
            conv_in, self.conv_weight[...], None, conv0, batch.cu_q_lens, batch.num_seqs
        )
        qkv = jax.nn.silu(qkv).reshape(T, Hk, conv_w)
        q, k, v = jnp.split(qkv, [Dk, 2 * Dk], axis=-1)  # [T, Hk, Dk] x2, [T, Hk, r*Dv]
        # Each query/key head serves its group's r value heads (value head j reads key head j // r).
        q = jnp.repeat(l2norm(q) * Dk**-0.5, r, axis=1)  # [T, Hv, Dk] float32
        k = jnp.repeat(l2norm(k), r, axis=1)
        v = v.reshape(T, Hv, Dv)
        beta = jax.nn.sigmoid(b.reshape(T, Hv).astype(jnp.float32))
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        dt = a.reshape(T, Hv).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        decay = A * jax.nn.softplus(dt)  # [T, Hv] log-decay g
        conv = scatter_states(st.conv, batch.state_slots, live, conv_new)
        o, ssm = state_trail.recurrence("gdn", self.kernels, (q, k, v, decay, beta), st.ssm, batch)
        conv = state_trail.conv_trail(conv, conv0, conv_in, batch)  # + the trail's (verify steps)
        o = self.norm(o.astype(x.dtype), z.reshape(T, Hv, Dv))  # [T, Hv, Dv]
        new = RecurrentState(conv=conv, ssm=ssm)
        return new, self.out_proj(o.reshape(T, g.value_dim))
