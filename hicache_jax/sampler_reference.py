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
    order = jnp.sort(x, axis=-1)[:, ::-1]  # [S, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    probs_sorted = jax.nn.softmax(jnp.where(order < kth, -jnp.inf, order), axis=-1)
    # top-p: keep the smallest prefix of the sorted distribution reaching top_p.
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep = (before < top_p[:, None]) | (top_p >= 1)[:, None]
    cutoff = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, -jnp.inf, x)
    return min_p_mask(x, min_p)


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
