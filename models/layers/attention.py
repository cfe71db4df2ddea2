"""Attention layer (full or sliding-window) over paged KV."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.models.batch import ForwardBatch, page_group
from hicache_jax.models.cache import KVPages
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels import backend, sharded
from hicache_jax.models.kv_quant import field_scales, rescale, unscale
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.norms import RMSNorm
from hicache_jax.models.layers.rope import apply_rope, rope_frequencies
from hicache_jax.models.sharding import kv_heads_on_device, tp_size

# Query rows per block in steps with prefill. Every block re-reads its keys, so long
# prompts favour large blocks, while each sequence of a mixed step (a decode token too)
# fills a whole block. The xla backend on CPU, 100m preset: a 4,096-token prefill's attention
# takes 0.7x the time at 16 as at 8; 31 decodes beside a 512-token chunk take 1.1x. The
# Pallas kernel plans its own from the chip's VMEM and MXU and the step's shape (None;
# ``ragged_paged_attention/kernel.py``'s ``plan``).
PREFILL_Q_BLOCK = {"xla": 16, "pallas": None}


def q_block(name: str, batch: ForwardBatch, tokens: int) -> int | None:
    """Query rows per block for a step of ``tokens`` rows: 1 in a decode step; else
    ``PREFILL_Q_BLOCK``, cut (xla) to the rows a sequence brings on average, rounded up to
    a power of two. A speculative verify step (``W`` rows per sequence) thus runs blocks of
    ``W`` rows, not 16 rows mostly empty that gather the same pages: on CPU, SmolLM2-135M's
    verify step at 300 cached tokens takes 0.68-0.75x the time at 4 x 4 rows, 0.70-0.85x at
    1 x 4 (``benchmarks/RESULTS.md``, speculative section). Steps with prompt chunks bring 16 or
    more rows per sequence on average, and keep 16."""
    if batch.decode_only:
        return 1
    block = PREFILL_Q_BLOCK[name]
    if block is None:
        return None
    per_seq = -(-tokens // batch.kv_lens.shape[0])
    return min(block, 1 << (per_seq - 1).bit_length())


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, kind: str, *, dtype, rngs: nnx.Rngs, kernels):
        H, Hkv, D, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.group = page_group(kind)
        self.window = cfg.window(kind)
        self.inv_freq, self.rope_scale = (), 1.0  # no RoPE (cfg.rope False): positions unused
        if cfg.rotary_dim:
            inv_freq, self.rope_scale = rope_frequencies(
                cfg.rope_base(kind), cfg.rotary_dim, cfg.rope_factor(kind), cfg.yarn(kind)
            )
            self.inv_freq = tuple(inv_freq.tolist())  # static (an array attribute would be state)
        self.scale = cfg.attn_scale
        self.soft_cap = cfg.attn_logit_softcap
        self.kernels = kernels
        # Per-tensor scales of the pages (``kv_quant.py``): ((k, v),), or None (1.0). Static
        # numbers set once the model is built (``CausalLM.set_kv_scales``).
        self.kv_scales = None
        # Fewer KV heads than shards: each shard stores a copy of the head it reads.
        self.kv_repeat = kv_heads_on_device(cfg, tp_size(kernels.mesh)) // Hkv
        bias = cfg.attention_bias
        # With the output gate, q_proj gives per head [query (D) | gate (D)], heads side by
        # side, so a split of its columns by head keeps each head's gate on its device.
        self.output_gate = cfg.attention_output_gate
        self.q_proj = Linear(h, H * D * (2 if self.output_gate else 1), bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, Hkv * D, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, Hkv * D, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(H * D, h, bias=bias, dtype=dtype, rngs=rngs)
        self.sinks = nnx.Param(jnp.zeros((H,), dtype)) if cfg.attention_sinks else None
        self.qk_norm_over = cfg.qk_norm_over
        if cfg.qk_norm:
            whole = cfg.qk_norm_over == "all"  # over all heads' channels together (Olmo)
            norm = lambda n: RMSNorm(n, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)  # noqa: E731
            self.q_norm, self.k_norm = norm(H * D if whole else D), norm(Hkv * D if whole else D)
        else:
            self.q_norm = self.k_norm = None

    @jax.named_scope("attention")
    def __call__(self, kv: KVPages, x: jax.Array, batch: ForwardBatch) -> tuple[KVPages, jax.Array]:
        T = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.output_gate:  # [T, H, 2D] -> query, gate
            q, gate = jnp.split(q.reshape(T, self.num_heads, 2 * self.head_dim), 2, axis=-1)
            q = q.reshape(T, -1)
        if self.q_norm is not None and self.qk_norm_over == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_over == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.inv_freq:
            rope = dict(inv_freq=self.inv_freq, scale=self.rope_scale)
            q = apply_rope(q, batch.positions, **rope)
            k = apply_rope(k, batch.positions, **rope)
        if self.kv_repeat > 1:
            k, v = jnp.repeat(k, self.kv_repeat, axis=1), jnp.repeat(v, self.kv_repeat, axis=1)
        name, interpret, mesh = self.kernels.attention_backend, self.kernels.interpret, self.kernels.mesh
        write = sharded.kv_write(backend.kv_write_fn(name, interpret), mesh)
        k_scale, v_scale = field_scales(self.kv_scales, 0, 2)
        with jax.named_scope("kv_write"):
            k, v = unscale(k, k_scale), unscale(v, v_scale)  # the write stores them
            k_pages, v_pages = write(kv.k, kv.v, k, v, batch.slot_mappings[self.group])
        # Scaled pages: the key scale folds into the softmax scale (the soft cap and the sinks
        # see the true logits), the value scale multiplies the output.
        attend = sharded.attention(
            backend.attention_fn(name, interpret),
            mesh,
            sm_scale=self.scale * k_scale,
            sliding_window=self.window,
            soft_cap=self.soft_cap,
            q_block=q_block(name, batch, T),
            sinks=self.sinks is not None,
        )
        sinks = () if self.sinks is None else (self.sinks[...].astype(jnp.float32),)
        o = attend(
            q,
            k_pages,
            v_pages,
            batch.kv_lens,
            batch.page_tables[self.group],
            batch.cu_q_lens,
            batch.num_seqs,
            *sinks,
        )
        o = rescale(o, v_scale)
        if gate is not None:
            o = o.astype(x.dtype) * jax.nn.sigmoid(gate)
        return KVPages(k_pages, v_pages), self.o_proj(o.reshape(T, -1))
