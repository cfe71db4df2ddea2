"""int8 pages' per-tensor scales, from one calibration pass (``kv_quant.py``).

The model runs once from an empty float32 cache over a fixed token sequence (a drafting
block too, over the model's hidden states, as it drafts); each layer's each cache field
then has its largest magnitude ``amax`` over every row written, and its scale is
``amax * HEADROOM / 127``. The sequence is a function of the vocabulary size alone and the
pass is one compiled program, so the scales (and the L3 scheme named after them) are the
same on every run on one platform.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hicache_jax.models.cache import layer_specs, parts
from hicache_jax.models.kv_quant import INT8_MAX, KVScales

# Tokens of the calibration sequence: long enough that every layer sees positions well past
# the first few (the first token's keys are often the largest), short enough to cost one
# small prefill at start-up.
CALIBRATION_TOKENS = 256
# The scale's range over the measured amax (more keeps larger served values off saturation,
# at a coarser step). SmolLM2-135M-Instruct, prompt logprobs of 190 tokens of English
# against float32 pages, mean |delta| for headroom 0.8 / 1.0 / 1.25 / 1.5 / 2.0: 0.075 /
# 0.062 / 0.064 / 0.086 / 0.127 (float8_e4m3fn: 0.069; calibrated on that text itself
# instead of these tokens, 1.0 gives 0.044). Rounding error outweighs the rare clipping.
HEADROOM = 1.0


def calibration_ids(vocab_size: int, bos_token_id: int | None = None, n: int = CALIBRATION_TOKENS):
    """The fixed sequence: ``n`` ids drawn with a fixed seed (after the BOS id, if any)."""
    ids = np.random.default_rng(0).integers(0, vocab_size, n).astype(np.int32)
    if bos_token_id is not None:
        ids[0] = bos_token_id
    return ids


@nnx.jit
def _pass(model, cache, batch):
    """The cache after the calibration step (the drafting block's entry written by the first
    block over the model's hidden states, each fed the next token)."""
    if not (model.cfg.mtp_cache_layers and model.mtp is not None):
        return model(cache, batch)[0]
    cache, _, states = model(cache, batch, hidden=True)
    # Position t's hidden state with token t + 1, as a drafting step pairs them.
    ahead = dataclasses.replace(batch, input_ids=jnp.roll(batch.input_ids, -1))
    entry, _, _ = model.mtp[0](cache[-1], states, ahead, model.embed, model.unembed)
    return cache[:-1] + (entry,)


def amax(model, ids: np.ndarray | None = None) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """Per cache layer, per paged spec, per field: the largest magnitude the calibration
    pass writes (0.0 for a spec with its own dtype: compressor state is never scaled)."""
    cfg = model.cfg
    if ids is None:
        ids = calibration_ids(cfg.vocab_size, cfg.bos_token_id)
    saved = model.kv_scales
    model.set_kv_scales(None)  # the true values, unscaled
    try:
        cache, batch = model.full_batch(jnp.asarray(ids, jnp.int32)[None], kv_dtype=jnp.float32)
        last = jnp.asarray([len(ids) - 1], jnp.int32)  # one logits row: nothing reads them
        cache = _pass(model, cache, dataclasses.replace(batch, logits_indices=last))
    finally:
        model.set_kv_scales(saved)
    return cache_amax(cfg, cache)


def cache_amax(cfg, cache) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """``amax``'s numbers from a cache written without scales."""
    out = []
    for specs, entry in zip(layer_specs(cfg), cache, strict=True):
        per_spec = []
        for spec, arrays in zip(specs, parts(entry, specs) if specs else (), strict=True):
            if spec.dtype is not None:
                per_spec.append((0.0,) * len(arrays))
            else:
                per_spec.append(tuple(float(jax.device_get(jnp.max(jnp.abs(a)))) for a in arrays))
        out.append(tuple(per_spec))
    return tuple(out)


def scales_from_amax(amaxes, headroom: float = HEADROOM) -> KVScales:
    """``amax * headroom / 127`` per field; 1.0 where nothing was measured (an unscaled spec,
    a field the pass left at zero)."""
    return KVScales(
        tuple(
            tuple(tuple(a * headroom / INT8_MAX if a > 0 else 1.0 for a in spec) for spec in layer)
            for layer in amaxes
        )
    )


def calibrate(model, ids: np.ndarray | None = None, headroom: float = HEADROOM) -> KVScales:
    """int8 scales for ``model``'s pages (``CausalLM.set_kv_scales`` takes them)."""
    return scales_from_amax(amax(model, ids), headroom)
