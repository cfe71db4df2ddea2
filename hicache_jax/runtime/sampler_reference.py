"""The reference sampler: the definition the bounded sampler in ``sampler.py`` must match.

Every row applies temperature, then the top-k, top-p and min-p masks over the whole
vocabulary (cuts found by search, not by sorting: ``filtered_logits``), and draws with
``jax.random.categorical``. ``sampler.py`` calls
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
    masked entries become -inf.

    - top-k keeps the values at or above the k-th largest;
    - top-p keeps a value when the probability of the values strictly above it (after top-k)
      is under top_p: the smallest prefix of the sorted distribution that reaches top_p,
      with ties kept or dropped together;
    - min-p drops values under min_p x the top probability.

    No sort: both cuts are found by a bitwise search over the values' order keys (``_keys``),
    32 masked counts or sums over [V] each, and compile in well under a second for TPU
    (a sort of a 32,768- to 262,144-wide row takes 8-13 s there, and every serving program
    carries one: ``sampler.py``'s fallback rows)."""
    V = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-5)[:, None]
    u = _keys(x)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    # the k-th largest key: the largest t with at least k keys >= t
    kth = _largest_where(lambda t: (u >= t[:, None]).sum(-1) >= k, x.shape[0])
    x = jnp.where(u >= kth[:, None], x, -jnp.inf)
    p = jax.nn.softmax(x, axis=-1)
    # the top-p cut: one past the largest t whose strictly-greater mass still reaches top_p
    over = _largest_where(lambda t: jnp.where(u > t[:, None], p, 0.0).sum(-1) >= top_p, x.shape[0])
    keep = (u > over[:, None]) | (top_p >= 1)[:, None]
    x = jnp.where(keep, x, -jnp.inf)
    return min_p_mask(x, min_p)


def _keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order: the bits, with the sign flipped for positives
    and every bit flipped for negatives (-0.0 first made +0.0; NaNs one key above +inf)."""
    i = jax.lax.bitcast_convert_type(jnp.where(jnp.isnan(x), jnp.nan, x + 0.0), jnp.uint32)
    return jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(1 << 31))


def _largest_where(ok, S: int) -> jax.Array:
    """[S]: per row the largest uint32 t with ``ok(t)`` true (``ok``: [S] -> [S] bools,
    monotone: true up to some t, false above), built bit by bit from the top; 0 when only
    t = 0 (or none) holds."""

    def bit(i, t):
        trial = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(ok(trial), trial, t)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros((S,), jnp.uint32))


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
