"""Mamba2 mixer: in-projection, causal conv, SSD scan, gated RMSNorm, out-projection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.cache import MambaState
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels import state_trail
from hicache_jax.models.kernels.mamba2_ssd.chunked import gather_states, scatter_states
from hicache_jax.models.kernels.mamba2_ssd.conv import causal_conv1d
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.norms import GatedRMSNorm


class Mamba2Mixer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, kernels):
        m = cfg.mamba
        self.cfg = m
        self.kernels = kernels
        I, H = m.intermediate_size, m.num_heads
        self.in_proj = Linear(cfg.hidden_size, I + m.conv_dim + H, bias=m.proj_bias, dtype=dtype, rngs=rngs)
        self.conv_weight = nnx.Param(
            (jax.random.normal(rngs.params(), (m.conv_kernel, m.conv_dim)) * 0.5).astype(dtype)
        )
        self.conv_bias = nnx.Param(jnp.zeros((m.conv_dim,), dtype)) if m.conv_bias else None
        self.dt_bias = nnx.Param(jnp.ones((H,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, H + 1, dtype=jnp.float32)).astype(dtype))
        self.D = nnx.Param(jnp.ones((H,), dtype))
        self.norm = GatedRMSNorm(I, I // m.num_groups, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(I, cfg.hidden_size, bias=m.proj_bias, dtype=dtype, rngs=rngs)

    @jax.named_scope("mamba")
    def __call__(self, st: MambaState, x: jax.Array, batch: ForwardBatch) -> tuple[MambaState, jax.Array]:
        m = self.cfg
        T = x.shape[0]
        I, H, P, G, N = m.intermediate_size, m.num_heads, m.head_dim, m.num_groups, m.state_size
        z, xbc, dt = jnp.split(self.in_proj(x), [I, I + m.conv_dim], axis=-1)

        conv0, live = gather_states(st.conv, batch.state_slots, batch.has_initial_state, batch.num_seqs)
        bias = self.conv_bias[...] if self.conv_bias is not None else None
        xbc_in = xbc
        xbc, conv_new = causal_conv1d(
            xbc, self.conv_weight[...], bias, conv0, batch.cu_q_lens, batch.num_seqs
        )
        xbc = jax.nn.silu(xbc)
        xs, B, C = jnp.split(xbc, [I, I + G * N], axis=-1)
        xs, B, C = xs.reshape(T, H, P), B.reshape(T, G, N), C.reshape(T, G, N)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.clip(dt, m.dt_min, m.dt_max)
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        D = self.D[...].astype(jnp.float32)
        conv = scatter_states(st.conv, batch.state_slots, live, conv_new)
        y, ssm = state_trail.recurrence("ssd", self.kernels, (xs, dt, A, B, C, D), st.ssm, batch)
        conv = state_trail.conv_trail(conv, conv0, xbc_in, batch)  # + the trail's (verify steps)
        y = self.norm(y.reshape(T, I), z)
        new = MambaState(conv=conv, ssm=ssm)
        return new, self.out_proj(y.astype(x.dtype))
