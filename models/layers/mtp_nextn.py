"""The multi-token-prediction (MTP) blocks of DeepSeek V3 / V3.2, GLM-5, Qwen3-Next and
Qwen3.5: drafters for speculative decoding (DeepSeek V4's, with residual streams, are
``layers/mtp.py``'s).

Block ``k`` of ``ModelConfig.nextn`` predicts the token after next from the hidden state of
the position before and the embedding of the next token::

    x      = proj(concat([enorm(embed(next_ids)), hnorm(hidden)]))   # [T, 2h] -> [T, h]
    x      = layer(x)                                                # an ordinary decoder layer
    logits = head(norm(x))

The embedding comes first in the concat, in both styles (vLLM's ``deepseek_mtp.py`` and
``qwen3_next_mtp.py``). The published tensors:

- DeepSeek style (``model.layers.<num_hidden_layers + k>.``): ``enorm``, ``hnorm``,
  ``eh_proj`` (the projection), ``shared_head.norm`` (``norm``), ``shared_head.head`` (the
  block's own LM head, read as the block's ``head``) and the layer's tensors (MLA or DSA
  attention, MoE). A copy of the embedding there (``embed_tokens``) must equal the model's.
- Qwen style (``mtp.``): ``pre_fc_norm_embedding`` (``enorm``), ``pre_fc_norm_hidden``
  (``hnorm``), ``fc``, ``norm`` and ``layers.<k>.*`` (a gated full-attention layer, MoE in
  Qwen3-Next); every norm scales by ``1 + w``; the LM head is the model's.

``hidden`` is what the peers feed: the main model's final-norm output, or for block ``k > 0``
(chained drafts) block ``k - 1``'s output, which is its layer's output in the DeepSeek style
and that output after ``norm`` in the Qwen style (as vLLM's two models return it). The main
forward does not call the blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.layers.linear import Linear
from hicache_jax.models.layers.norms import RMSNorm


class NextNBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: nnx.Module, *, dtype, rngs: nnx.Rngs):
        """``layer``: the block's decoder layer (a ``DecoderLayer`` of ``cfg.nextn.kind``),
        built by the model, which owns that class."""
        h, style = cfg.hidden_size, cfg.nextn.style

        def norm():
            return RMSNorm(h, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)

        self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
        self.proj = Linear(2 * h, h, bias=False, dtype=dtype, rngs=rngs)
        self.layer = layer
        self.head = (
            Linear(h, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs) if style == "deepseek" else None
        )
        self.chain_normed = style == "qwen"

    @property
    def kind(self) -> str:
        """The cache kind of the block's layer (its entry is allocated as a main layer's)."""
        return self.layer.kind

    def __call__(self, entry, hidden: jax.Array, batch: ForwardBatch, embed, unembed):
        """``hidden [T, h]``: each token's input (see the module docstring); ``batch.input_ids``
        the next tokens. ``embed`` is the model's ``Embed``, ``unembed`` its LM head (``[R, h]``
        -> logits; unused by a block with its own). Returns (new entry, the block's output
        ``[T, h]`` for the next block, logits ``[R, vocab]`` float32 for the rows
        ``batch.logits_indices``), as ``MTPBlock`` does."""
        e = self.enorm(embed(batch.input_ids))
        x = self.proj(jnp.concatenate([e, self.hnorm(hidden).astype(e.dtype)], axis=-1))
        entry, x, _ = self.layer(entry, x, batch)
        rows = self.norm(x[batch.logits_indices])
        logits = self.head(rows) if self.head is not None else unembed(rows)
        return entry, (self.norm(x) if self.chain_normed else x), logits.astype(jnp.float32)


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The one-layer config a block's own cache is allocated from (``allocate_cache``)."""
    return cfg.nextn_block_config()
