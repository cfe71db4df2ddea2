"""DeepSeek V4's multi-token-prediction (MTP) block: a drafter for speculative decoding.

Block ``k`` of ``Dsv4Config.num_nextn_predict_layers`` (the published ``mtp.<k>.*``
tensors) predicts the token after next from the residual streams of the position before
it and the embedding of the next token (DeepSeek's ``inference/model.py``, ``MTPBlock``)::

    e       = enorm(embed(next_ids))                        # [T, h]
    streams = e_proj(e)[:, None] + h_proj(hnorm(streams))   # [T, n, h]: per stream
    streams = layer(streams)                                # a V4 decoder layer
    logits  = head(norm(hc_head(streams)))                  # its own hc_head and norm

The embedding and the LM head are the main model's (the checkpoint has none of its own).
The layer is an ordinary ``HyperDecoderLayer`` of ``Dsv4Config.mtp_kind`` (the published
configs' ``compress_ratios`` entry past the last layer: 0, a sliding window), its MoE
routed by score (never by token id). Blocks chain for drafts past one token: block ``k``
takes the streams block ``k - 1`` returned. The main forward does not call them.
"""

from __future__ import annotations

import jax
from flax import nnx

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.layers.hyper import HyperDecoderLayer, HyperHead
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.norms import RMSNorm


class MTPBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs, kernels):
        h = cfg.hidden_size

        def norm():
            return RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)

        self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
        self.e_proj = Linear(h, h, bias=False, dtype=dtype, rngs=rngs)
        self.h_proj = Linear(h, h, bias=False, dtype=dtype, rngs=rngs)
        # Numbered after the main layers, as the published code numbers it: never a hash layer.
        layer = cfg.num_layers + index
        self.layer = HyperDecoderLayer(cfg, cfg.dsv4.mtp_kind, layer, dtype=dtype, rngs=rngs, kernels=kernels)
        self.head = HyperHead(cfg, rngs=rngs)

    @property
    def kind(self) -> str:
        """The cache kind of the block's layer (its entry is allocated as a main layer's)."""
        return self.layer.kind

    def __call__(self, entry, streams: jax.Array, batch: ForwardBatch, embed, unembed):
        """``streams [T, n, h]``: each token's input streams (the main model's last layer's
        output at the position before, or the previous block's); ``batch.input_ids`` the
        next tokens. ``embed`` is the model's ``Embed``, ``unembed`` its LM head (``[R, h]``
        -> logits). Returns (new entry, the block's output streams ``[T, n, h]`` for the
        next block, logits ``[R, vocab]`` float32 for the rows ``batch.logits_indices``)."""
        e = self.enorm(embed(batch.input_ids))
        x = self.e_proj(e)[:, None, :] + self.h_proj(self.hnorm(streams))
        entry, x, _ = self.layer(entry, x, batch)
        rows = self.norm(self.head(x[batch.logits_indices]))
        return entry, x, unembed(rows).astype(jax.numpy.float32)
