"""The decoder stack every supported architecture maps onto.

``model(cache, batch) -> (new_cache, logits)`` runs one ragged step over paged KV and
recurrent state slots; ``model.forward_full(ids)`` runs whole sequences from an empty cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.kinds import LayerKind
from hicache_jax.models.batch import ForwardBatch, page_groups
from hicache_jax.models.cache import allocate_cache, paged_specs
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.layers.attention import Attention
from hicache_jax.models.layers.gated_deltanet import GatedDeltaNet
from hicache_jax.models.layers.hyper import HyperDecoderLayer, HyperHead
from hicache_jax.models.layers.linear import Embed, Linear
from hicache_jax.models.layers.mamba2 import Mamba2Mixer
from hicache_jax.models.layers.mla import MLA
from hicache_jax.models.layers.mlp import MLP
from hicache_jax.models.layers.moe import MoE
from hicache_jax.models.layers.mtp import MTPBlock
from hicache_jax.models.layers.mtp_nextn import NextNBlock
from hicache_jax.models.layers.norms import RMSNorm
from hicache_jax.models.page_loads import land
from hicache_jax.models.sharding import (
    cache_shardings,
    check_tp,
    constrain,
    kv_heads_on_device,
    replicated,
    tp_size,
    vocab_sharding,
)

LATENT_KINDS = (LayerKind.MLA, LayerKind.DSA, LayerKind.DSA_SHARED)


class DecoderLayer(nnx.Module):
    """``x += mixer(norm(x)); x += mlp(norm(x))``, with Gemma's extra output norms, or
    (``pre_norms=False``, Olmo) only those: ``x += norm(mixer(x)); x += norm(mlp(x))``.
    ``mlp=False``: the mixer half alone. Each half's output is scaled by
    ``residual_multiplier`` (Granite) before it is added."""

    def __init__(
        self,
        cfg: ModelConfig,
        kind: str,
        *,
        dtype,
        rngs: nnx.Rngs,
        kernels,
        sparse: bool = False,
        mlp: bool = True,
    ):
        def norm():
            return RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)

        self.kind = kind
        self.residual_multiplier = cfg.residual_multiplier
        post = cfg.sandwich_norms or not cfg.pre_norms
        self.input_norm = norm() if cfg.pre_norms else None
        if kind == LayerKind.MAMBA:
            self.mixer = Mamba2Mixer(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        elif kind == LayerKind.GDN:
            self.mixer = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        elif kind in LATENT_KINDS:
            self.mixer = MLA(cfg, kind, dtype=dtype, rngs=rngs, kernels=kernels)
        else:
            self.mixer = Attention(cfg, kind, dtype=dtype, rngs=rngs, kernels=kernels)
        self.post_mixer_norm = norm() if post else None
        self.pre_mlp_norm = norm() if cfg.pre_norms and mlp else None
        if not mlp:
            self.mlp = None
        elif sparse:
            moe = dict(mesh=kernels.mesh, path=kernels.moe_path)
            self.mlp = MoE(cfg.hidden_size, cfg.moe, dtype=dtype, rngs=rngs, **moe)
        else:
            self.mlp = MLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                activation=cfg.activation,
                gated=cfg.mlp_gated,
                dtype=dtype,
                rngs=rngs,
            )
        self.post_mlp_norm = norm() if post and mlp else None

    def __call__(self, entry, x: jax.Array, batch: ForwardBatch, picks=None):
        """Returns the new entry, the output and ``picks``: the positions a sparse-attention
        layer attended, which a following ``dsa_shared`` layer reuses (passed through by
        every other layer)."""
        h = x if self.input_norm is None else self.input_norm(x)
        if self.kind in LATENT_KINDS:
            entry, h, picks = self.mixer(entry, h, batch, picks)
        else:
            entry, h = self.mixer(entry, h, batch)
        if self.post_mixer_norm is not None:
            h = self.post_mixer_norm(h)
        x = x + self._scaled(h)
        if self.mlp is None:
            return entry, x, picks
        h = self.mlp(x if self.pre_mlp_norm is None else self.pre_mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return entry, x + self._scaled(h), picks

    def _scaled(self, h: jax.Array) -> jax.Array:
        if self.residual_multiplier == 1.0:
            return h
        return h * jnp.asarray(self.residual_multiplier, h.dtype)


class CausalLM(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        kernels: KernelConfig | None = None,
        kv_dtype=None,
    ):
        rngs = rngs or nnx.Rngs(0)
        kernels = kernels or KernelConfig()
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        # The pages' dtype (``--kv_cache_dtype``, ``kv_quant.py``): the model's unless set.
        self.kv_dtype = self.dtype if kv_dtype is None else jnp.dtype(kv_dtype)
        self.kv_scales = None  # the pages' per-tensor scales (``set_kv_scales``); None: 1.0
        self.mesh = kernels.mesh  # tensor-parallel mesh, or None (see models/sharding.py)
        check_tp(cfg, tp_size(self.mesh))
        kernels.check_model(cfg, self.dtype)
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        if cfg.dsv4 is not None:  # DeepSeek V4: residual streams (``layers/hyper.py``)
            made = [
                HyperDecoderLayer(cfg, k, i, dtype=dtype, rngs=rngs, kernels=kernels)
                for i, k in enumerate(cfg.layer_kinds)
            ]
            self.layers = nnx.List(made)
            self.hc_head = HyperHead(cfg, rngs=rngs)
        else:
            self.hc_head = None
            self.layers = nnx.List(
                [
                    DecoderLayer(
                        cfg,
                        k,
                        dtype=dtype,
                        rngs=rngs,
                        kernels=kernels,
                        sparse=i in cfg.sparse_layers,
                        mlp=i not in cfg.mlp_free_layers,
                    )
                    for i, k in enumerate(cfg.layer_kinds)
                ]
            )
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )
        # Multi-token-prediction blocks, kept for drafting: DeepSeek V4's (``layers/mtp.py``)
        # or a ``NextNConfig``'s (``layers/mtp_nextn.py``); ``__call__`` does not run them.
        # None without any.
        nextn = cfg.dsv4.num_nextn_predict_layers if cfg.dsv4 is not None else 0
        if nextn:
            self.mtp = nnx.List(
                [MTPBlock(cfg, i, dtype=dtype, rngs=rngs, kernels=kernels) for i in range(nextn)]
            )
        elif cfg.nextn is not None:
            x = cfg.nextn
            self.mtp = nnx.List(
                [
                    NextNBlock(
                        cfg,
                        DecoderLayer(cfg, x.kind, dtype=dtype, rngs=rngs, kernels=kernels, sparse=x.sparse),
                        dtype=dtype,
                        rngs=rngs,
                    )
                    for _ in range(x.num_layers)
                ]
            )
        else:
            self.mtp = None

    def __call__(self, cache: tuple, batch: ForwardBatch, *, hidden: bool = False):
        """One step: returns the updated cache and float32 logits ``[R, vocab]`` for the rows
        ``batch.logits_indices``; with ``hidden``, also every token row's final-norm output
        ``[T, hidden_size]`` (what a multi-token-prediction block drafts from; DeepSeek V4's
        read the last layer's residual streams ``[T, hc_mult, hidden_size]``), or with
        ``ModelConfig.eagle3_aux`` the residual stream at its three boundaries, concatenated
        ``[T, 3 * hidden_size]`` (what an EAGLE-3 draft reads). Cache entries
        past the main layers (``ModelConfig.cache_layer_kinds``: the drafting block's) pass
        through unchanged."""
        cfg = self.cfg
        x = self.embed(batch.input_ids)
        if cfg.embed_scale != 1.0:
            x = x * jnp.asarray(cfg.embed_scale, self.dtype)
        if self.hc_head is not None:  # the residual streams start as copies of the embedding
            x = jnp.broadcast_to(x[:, None, :], (x.shape[0], cfg.dsv4.hc_mult, x.shape[1]))
        new_cache, picks = [], None
        main, tail = cache[: len(self.layers)], tuple(cache[len(self.layers) :])
        aux = {}  # boundary -> the residual stream there (an EAGLE-3 draft's, ``eagle3_aux``)
        for i, (layer, entry) in enumerate(zip(self.layers, main, strict=True)):
            if hidden and cfg.eagle3_aux is not None and i in cfg.eagle3_aux:
                aux[i] = x
            if batch.loads is not None and batch.loads.pages[i] is not None:
                entry, x = land(entry, x, batch.loads, i, paged_specs(cfg, layer.kind))
            entry, x, picks = layer(entry, x, batch, picks)
            new_cache.append(entry)
        states = None
        if hidden:  # every row's final-norm output, the logits rows' among them
            if self.hc_head is not None:  # DeepSeek V4's blocks read the residual streams
                if cfg.eagle3_aux is not None:
                    raise NotImplementedError("an EAGLE-3 draft on DeepSeek V4's residual streams")
                states, x = x, self.final_norm(self.hc_head(x[batch.logits_indices]))
            elif cfg.eagle3_aux is not None:  # boundary L: the last layer's output, unnormed
                aux[len(self.layers)] = x
                states = jnp.concatenate([aux[b] for b in cfg.eagle3_aux], axis=-1)
                x = self.final_norm(x[batch.logits_indices])
            else:
                states = self.final_norm(x)
                x = states[batch.logits_indices]
        else:
            x = x[batch.logits_indices]
            if self.hc_head is not None:
                x = self.hc_head(x)
            x = self.final_norm(x)
        logits = self.unembed(x)
        # Each device computes its vocabulary shard (left to itself, XLA gathers the whole
        # embedding instead), and the logits stay split: the sampler gathers the rows it
        # samples from and reduces the others' logprobs across the shards, so no chip holds
        # [rows, vocab] float32 whole (0.5 GiB for 544 rows of Gemma 3's 262,208).
        logits = constrain(logits, vocab_sharding(cfg, self.mesh)).astype(jnp.float32)
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcap:
            cap = cfg.final_logit_softcap
            logits = cap * jnp.tanh(logits / cap)
        if hidden:
            return tuple(new_cache) + tail, logits, states
        return tuple(new_cache) + tail, logits

    def unembed(self, x: jax.Array) -> jax.Array:
        """The LM head (the tied embedding, or ``lm_head``): ``[R, hidden]`` -> ``[R, vocab]``."""
        return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)

    def set_kv_scales(self, scales) -> None:
        """Give every layer that writes pages (a drafting block's too) its per-tensor scales
        (``kv_quant.KVScales``, ``cache_layer_kinds`` order; None: 1.0). Static numbers in
        the layers' programs: set before the runner splits the model."""
        self.kv_scales = scales
        mixers = [layer.mixer for layer in self.layers]
        if self.cfg.mtp_cache_layers and self.mtp is not None:
            # Every block writes the one drafting cache entry (only the first drafts).
            mixers += [[b.attn if hasattr(b, "attn") else b.layer.mixer for b in self.mtp]]
        for i, mixer in enumerate(mixers):
            layer = None if scales is None else scales.per_layer[i]
            for m in mixer if isinstance(mixer, list) else [mixer]:
                if hasattr(m, "kv_scales"):  # recurrent layers page nothing
                    m.kv_scales = layer

    def full_batch(self, input_ids: jax.Array, **cache_kwargs) -> tuple[tuple, ForwardBatch]:
        """An empty cache (``allocate_cache(**cache_kwargs)``) and the step that runs whole
        sequences ``[B, T]`` of ids from it, every row's logits."""
        Bsz, T = input_ids.shape
        P = -(-T // self.cfg.page_multiple) * self.cfg.page_multiple  # pages hold whole entries
        cache = self.allocate_cache(num_pages=Bsz, page_size=P, num_state_slots=Bsz, **cache_kwargs)
        seqs = jnp.arange(Bsz, dtype=jnp.int32)
        groups = page_groups(self.cfg.cache_layer_kinds)
        slots = (seqs[:, None] * P + jnp.arange(T, dtype=jnp.int32)[None, :]).reshape(-1)
        batch = ForwardBatch(
            input_ids=input_ids.reshape(-1).astype(jnp.int32),
            positions=jnp.tile(jnp.arange(T, dtype=jnp.int32), Bsz),
            cu_q_lens=jnp.arange(Bsz + 1, dtype=jnp.int32) * T,
            kv_lens=jnp.full((Bsz,), T, jnp.int32),
            num_seqs=jnp.int32(Bsz),
            page_tables={g: seqs[:, None] for g in groups},
            slot_mappings={g: slots for g in groups},
            state_slots=seqs,
            has_initial_state=jnp.zeros((Bsz,), bool),
            logits_indices=jnp.arange(Bsz * T, dtype=jnp.int32),
        )
        return cache, batch

    def forward_full(self, input_ids: jax.Array) -> jax.Array:
        """Whole sequences from an empty cache: ``[B, T]`` ids -> ``[B, T, vocab]`` logits."""
        _, logits = self(*self.full_batch(input_ids))
        return logits.reshape(*input_ids.shape, -1)

    def allocate_cache(self, **kwargs) -> tuple:
        """Zeroed cache arrays, split over the mesh like ``cache_shardings`` says."""
        kwargs.setdefault("dtype", self.dtype)
        kwargs.setdefault("kv_dtype", self.kv_dtype)
        if self.mesh is None:
            return allocate_cache(self.cfg, **kwargs)
        kwargs["kv_heads"] = kv_heads_on_device(self.cfg, tp_size(self.mesh))
        return jax.jit(
            lambda: allocate_cache(self.cfg, **kwargs), out_shardings=cache_shardings(self.cfg, self.mesh)
        )()

    def cache_shapes(self, *, placement: jax.sharding.Mesh, **kwargs) -> tuple:
        """``allocate_cache``'s arrays as ``jax.ShapeDtypeStruct``s with their shardings (on
        the model's mesh, or replicated on ``placement``); nothing is allocated."""
        kwargs.setdefault("dtype", self.dtype)
        kwargs.setdefault("kv_dtype", self.kv_dtype)
        tp = tp_size(self.mesh)
        if self.mesh is not None:
            kwargs["kv_heads"] = kv_heads_on_device(self.cfg, tp)
        shapes = jax.eval_shape(lambda: allocate_cache(self.cfg, **kwargs))
        where = self.cache_shardings() or jax.tree_util.tree_map(lambda _: replicated(placement), shapes)
        return jax.tree_util.tree_map(
            lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w), shapes, where
        )

    def cache_shardings(self) -> tuple | None:
        return None if self.mesh is None else cache_shardings(self.cfg, self.mesh)
