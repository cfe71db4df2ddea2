"""Manifold-constrained hyper-connections (DeepSeek V4): ``hc_mult`` residual streams.

A layer's input is ``[T, n, hidden]``. Around each block (attention, then the MoE), a small
projection of the flattened, normed streams gives per token three mixes: ``pre [n]`` collapses
the streams into the block's input, ``post [n]`` spreads the block's output back over them,
and ``comb [n, n]`` (pushed towards doubly stochastic by Sinkhorn-Knopp iterations) mixes the
streams themselves::

    streams' = post * block(norm(sum_j pre_j streams_j)) + comb^T streams

The mixes are computed in float32 (transformers keeps these modules in float32). After the
last layer ``HyperHead`` collapses the streams with its own ``pre`` before the final norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.layers.dsv4 import Dsv4Attention
from hicache_jax.models.layers.moe import MoE
from hicache_jax.models.layers.norms import RMSNorm, rms_normalize


def _init(rngs: nnx.Rngs, shape) -> jax.Array:
    """transformers' initialisation of the mixing projections (normal, std 0.02): random
    models mix their streams by their input, as trained ones do."""
    return jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02


class HyperConnection(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        v = cfg.dsv4
        n = v.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, v.hc_sinkhorn_iters, v.hc_eps, cfg.rms_norm_eps
        self.fn = nnx.Param(_init(rngs, ((2 + n) * n, n * cfg.hidden_size)))
        self.base = nnx.Param(jnp.zeros(((2 + n) * n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))

    def __call__(self, streams: jax.Array):
        """``streams [T, n, h]`` -> (``post [T, n]``, ``comb [T, n, n]``, the block's input
        ``[T, h]``), the mixes float32."""
        T, n = streams.shape[0], self.n
        flat = rms_normalize(streams.reshape(T, -1), self.norm_eps)
        mixes = flat @ self.fn[...].astype(jnp.float32).T
        base, scale = self.base[...].astype(jnp.float32), self.scale[...].astype(jnp.float32)
        pre = jax.nn.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + self.eps
        post = 2 * jax.nn.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = mixes[:, 2 * n :].reshape(T, n, n) * scale[2] + base[2 * n :].reshape(n, n)
        comb = jax.nn.softmax(comb, axis=-1) + self.eps
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + self.eps)
            comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        collapsed = jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=1).astype(streams.dtype)
        return post, comb, collapsed


def expand(streams: jax.Array, out: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """``post * out + comb^T streams``: stream ``k`` gets ``sum_j comb[j, k] streams[j]``."""
    dt = streams.dtype
    mixed = jnp.einsum("tjk,tjh->tkh", comb.astype(dt), streams)
    return post.astype(dt)[..., None] * out[:, None, :] + mixed


class HyperHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n = cfg.dsv4.hc_mult
        self.eps, self.norm_eps = cfg.dsv4.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nnx.Param(_init(rngs, (n, n * cfg.hidden_size)))
        self.hc_base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))

    def __call__(self, streams: jax.Array) -> jax.Array:
        flat = rms_normalize(streams.reshape(streams.shape[0], -1), self.norm_eps)
        mixes = flat @ self.hc_fn[...].astype(jnp.float32).T
        pre = jax.nn.sigmoid(mixes * self.hc_scale[...].astype(jnp.float32) + self.hc_base[...]) + self.eps
        return jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=1).astype(streams.dtype)


class HyperDecoderLayer(nnx.Module):
    """A DeepSeek V4 layer over the streams: attention, then the MoE (every layer has one;
    those in ``Dsv4Config.hash_layers`` choose experts by token id)."""

    def __init__(self, cfg: ModelConfig, kind: str, layer: int, *, dtype, rngs: nnx.Rngs, kernels):
        self.kind = kind
        self.attn_hc = HyperConnection(cfg, rngs=rngs)
        self.ffn_hc = HyperConnection(cfg, rngs=rngs)
        self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mixer = Dsv4Attention(cfg, kind, dtype=dtype, rngs=rngs, kernels=kernels)
        hashed = cfg.vocab_size if layer in cfg.dsv4.hash_layers else 0
        moe = dict(mesh=kernels.mesh, path=kernels.moe_path, hash_vocab=hashed)
        self.mlp = MoE(cfg.hidden_size, cfg.moe, dtype=dtype, rngs=rngs, **moe)

    def __call__(self, entry, streams: jax.Array, batch: ForwardBatch, picks=None):
        post, comb, h = self.attn_hc(streams)
        entry, h = self.mixer(entry, self.input_norm(h), batch)
        streams = expand(streams, h, post, comb)
        post, comb, h = self.ffn_hc(streams)
        h = self.mlp(self.pre_mlp_norm(h), ids=batch.input_ids)
        return entry, expand(streams, h, post, comb), picks
