"""Sampling and logprobs on device, for a whole batch in one jitted call.

Each sequence row carries its own settings; a row's random key is
``fold_in(PRNGKey(seed), number of tokens it has generated)``, so a request produces the
same tokens whether it runs alone, in a crowd, or after being retracted and resumed.
Logprobs are those of the model's raw distribution (``log_softmax(logits)``), as SGLang
reports them, whatever temperature or filters the sampling uses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    last_rows: jax.Array  # [S] int32: logits row of each sequence's last token
    temperature: jax.Array  # [S] float32 (0: greedy)
    top_p: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32 (-1: off)
    min_p: jax.Array  # [S] float32
    seeds: jax.Array  # [S] uint32
    counters: jax.Array  # [S] int32: tokens generated so far
    targets: jax.Array  # [R] int32: token whose logprob each row reports (-1: none)


jax.tree_util.register_dataclass(
    SamplingInputs,
    data_fields=[f.name for f in dataclasses.fields(SamplingInputs)],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class SamplingOutputs:
    next_ids: jax.Array  # [S] int32
    next_logprobs: jax.Array  # [S] float32
    next_top_ids: jax.Array  # [S, K]
    next_top_logprobs: jax.Array  # [S, K]
    target_logprobs: jax.Array  # [R] float32
    row_top_ids: jax.Array  # [R, K]
    row_top_logprobs: jax.Array  # [R, K]


jax.tree_util.register_dataclass(
    SamplingOutputs,
    data_fields=[f.name for f in dataclasses.fields(SamplingOutputs)],
    meta_fields=[],
)


def _filtered_logits(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """Temperature, then top-k, top-p and min-p masks; masked entries become -inf."""
    V = logits.shape[-1]
    x = logits / jnp.maximum(s.temperature, 1e-5)[:, None]
    order = jnp.sort(x, axis=-1)[:, ::-1]  # [S, V] descending
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    probs_sorted = jax.nn.softmax(jnp.where(order < kth, -jnp.inf, order), axis=-1)
    # top-p: keep the smallest prefix of the sorted distribution reaching top_p.
    before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep = before < s.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, -jnp.inf, x)
    # min-p: drop tokens below min_p x the top probability.
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs < s.min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x)
    return x


def sample(logits: jax.Array, s: SamplingInputs, top_logprobs: int) -> SamplingOutputs:
    """logits: [R, V] float32 for the batch's logits rows."""
    logp_rows = jax.nn.log_softmax(logits, axis=-1)  # [R, V]
    logits_s = logits[s.last_rows]  # [S, V]
    logp_s = logp_rows[s.last_rows]
    greedy = jnp.argmax(logits_s, axis=-1)
    keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.PRNGKey(seed), n))(s.seeds, s.counters)
    drawn = jax.vmap(jax.random.categorical)(keys, _filtered_logits(logits_s, s))
    next_ids = jnp.where(s.temperature < 1e-5, greedy, drawn).astype(jnp.int32)
    next_lp = jnp.take_along_axis(logp_s, next_ids[:, None], axis=-1)[:, 0]
    target_lp = jnp.take_along_axis(logp_rows, jnp.maximum(s.targets, 0)[:, None], axis=-1)[:, 0]
    K = top_logprobs
    if K:
        row_top_lp, row_top_ids = jax.lax.top_k(logp_rows, K)
    else:
        row_top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        row_top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SamplingOutputs(
        next_ids=next_ids,
        next_logprobs=next_lp,
        next_top_ids=row_top_ids[s.last_rows],
        next_top_logprobs=row_top_lp[s.last_rows],
        target_logprobs=target_lp,
        row_top_ids=row_top_ids,
        row_top_logprobs=row_top_lp,
    )
