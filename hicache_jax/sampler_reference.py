"""The full-sort sampler: the definition the bounded sampler in ``sampler.py`` must match.

Every row sorts the whole vocabulary, applies temperature, then the top-k, top-p and min-p
masks, and draws with ``jax.random.categorical``. ``sampler.py`` calls
``filtered_logits`` for the rare rows whose filters need more than its candidate set, and
the tests and ``benchmarks/sampler.py`` compare the two draws token for token.

One change from the sampler this was taken from: ``top_p >= 1`` now means "no top-p cut".
Before, ``before < top_p`` with ``top_p == 1`` still dropped the far tail of a peaked
distribution once the float32 cumulative sum rounded up to 1.0 (up to all but a few of a
32000 vocabulary, together holding ~3e-7 of the probability), so "off" was not off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filtered_logits(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, min_p: jax.Array
) -> jax.Array:
    """logits [S, V]; settings [S]. Temperature, then top-k, top-p and min-p masks;
    masked entries become -inf."""
    V = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-5)[:, None]
    order = sorted_values(x)[:, ::-1]  # [S, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    probs_sorted = jax.nn.softmax(jnp.where(order < kth, -jnp.inf, order), axis=-1)
    # top-p: keep the smallest prefix of the sorted distribution reaching top_p.
    before = cumulative_sum(probs_sorted) - probs_sorted
    keep = (before < top_p[:, None]) | (top_p >= 1)[:, None]
    cutoff = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, -jnp.inf, x)
    return min_p_mask(x, min_p)


def sorted_values(x: jax.Array) -> jax.Array:
    """x [..., V] float32 -> its values in ascending order along the last axis, as
    ``jnp.sort`` orders them (NaN last), sorted as int32 keys.

    The keys are the floats' bits with the negatives' magnitude bits flipped, so integer
    order is float order (-0.0 is first made +0.0; NaNs become one positive NaN, the
    largest key). An integer sort of values only needs no stability; for TPU it compiles
    in about 1.5 s where ``jnp.sort`` on floats takes 8-13 s (its comparator converts both
    operands on every comparison), and every serving program carries one (``sampler.py``'s
    fallback rows). The order can differ from XLA:CPU's only among denormals and zeros,
    which that backend compares as equal (it flushes denormals to zero)."""
    flip = jnp.int32(0x7FFFFFFF)
    keys = jax.lax.bitcast_convert_type(jnp.where(jnp.isnan(x), jnp.nan, x + 0.0), jnp.int32)
    keys = jax.lax.sort(jnp.where(keys < 0, keys ^ flip, keys), dimension=x.ndim - 1, is_stable=False)
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ flip, keys), x.dtype)


CUMSUM_BLOCK = 1024


def cumulative_sum(x: jax.Array, block: int = CUMSUM_BLOCK) -> jax.Array:
    """x [..., V] -> its inclusive cumulative sum along the last axis, in two levels: within
    blocks of ``block``, then over the blocks' totals. Equal to ``jnp.cumsum`` up to float
    rounding (a different order of additions); for TPU it compiles in under a second where
    ``jnp.cumsum`` of a 262,144-wide row takes about 7 s."""
    V = x.shape[-1]
    pad = -V % block
    y = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, block)
    within = jnp.cumsum(y, axis=-1)
    totals = within[..., -1]
    offsets = jnp.cumsum(totals, axis=-1) - totals
    return (within + offsets[..., None]).reshape(*x.shape[:-1], -1)[..., :V]


def min_p_mask(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """x [S, V] filtered logits: drop tokens below min_p x the top probability (O(V), no
    sort; the bounded sampler runs this same function on the same vector)."""
    probs = jax.nn.softmax(x, axis=-1)
    return jnp.where(probs < min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x)


def next_tokens(logits_s: jax.Array, s, keys: jax.Array) -> jax.Array:
    """logits_s [S, V]; s a ``SamplingInputs``; keys [S] the rows' keys -> [S] int32 tokens."""
    x = filtered_logits(logits_s, s.temperature, s.top_p, s.top_k, s.min_p)
    drawn = jax.vmap(jax.random.categorical)(keys, x)
    greedy = jnp.argmax(logits_s, axis=-1)
    return jnp.where(s.temperature < 1e-5, greedy, drawn).astype(jnp.int32)
