"""Model steps for the model tests, laid out by the engine's own ``BatchBuilder``.

A test names each sequence (its tokens, pages and Mamba state slot) and, per step, which of
its tokens the step feeds; the builder lays them out as the engine would. Shapes are the
tight ones (no buckets), so each test compiles as few programs as it needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hicache_jax.kinds import PAGED
from hicache_jax.models.batch import ForwardBatch, page_groups
from hicache_jax.models.cache import allocate_cache
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.request import Req
from hicache_jax.runtime.batch_builder import BatchBuilder
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler.plan import StepPlan, WorkItem


def jit_forward(model: CausalLM, compiler_options: dict | None = None):
    """``(params, step)``: a jitted ``step(params, cache, batch) -> (cache, logits)`` with the
    cache donated and the weights an argument (as the runner passes them)."""
    graphdef, params = nnx.split(model)

    def step(params, cache, batch):
        return nnx.merge(graphdef, params)(cache, batch)

    return params, jax.jit(step, donate_argnums=(1,), compiler_options=compiler_options)


def kv_groups(model: CausalLM) -> tuple[str, ...]:
    return page_groups(model.cfg.layer_kinds)


def sequence(tokens, pages, state_slot: int | None = None) -> Req:
    """A request holding the whole sequence ``tokens`` in ``pages`` (every page group)."""
    pages = [int(p) for p in pages]
    req = Req(rid=f"seq{state_slot}", input_ids=[int(t) for t in tokens], sampling=SamplingParams())
    req.cache.pages = {kind: list(pages) for kind in PAGED}
    req.cache.state_slot = state_slot
    return req


def build_step(
    work: list[tuple[Req, int, int]],
    *,
    groups: tuple[str, ...],
    page_size: int,
    max_pages: int,
    num_tokens: int | None = None,
    all_logits: bool = False,
) -> tuple[ForwardBatch, list]:
    """One step feeding tokens ``start:end`` of each ``(req, start, end)``.

    Returns the batch and, per sequence, the index of its logits rows: every fed token's
    (``all_logits``) or the last one's. Tokens pad to ``num_tokens`` when given."""
    plan = StepPlan([WorkItem(req, start, end, has_initial_state=start > 0) for req, start, end in work])
    S = len(plan.items)
    T = num_tokens or plan.num_tokens
    builder = BatchBuilder(
        page_size=page_size, groups=groups, max_running=S, max_prefill=T, max_pages=max_pages, vocab_size=512
    )
    shape = (T, S, T if all_logits else S, plan.decode_only)
    built = builder.build(plan, shape=shape)
    batch, first = built.batch, built.first_rows
    if all_logits:
        rows = [slice(f, f + i.num_tokens) for f, i in zip(first, plan.items)]
    else:
        rows = list(range(S))
    return batch, rows


def logits_of(logits, rows) -> np.ndarray:
    """The rows ``build_step`` named, in sequence order, as one host array."""
    logits = np.asarray(logits)
    return np.concatenate([logits[r] if isinstance(r, slice) else logits[r][None] for r in rows])


def whole_sequence(cfg, ids) -> tuple:
    """A one-layer ``cfg``'s empty cache entry (one page holding the sequence, state slot 0)
    and the batch feeding it the tokens ``ids``, every row's logits: how a lone MTP block is
    run."""
    T = len(ids)
    P = -(-T // cfg.page_multiple) * cfg.page_multiple
    (entry,) = allocate_cache(cfg, num_pages=1, page_size=P, num_state_slots=1)
    return entry, one_page_batch(page_groups(cfg.layer_kinds), ids, jnp.arange(T, dtype=jnp.int32))


def one_page_batch(groups, ids, logits_indices) -> ForwardBatch:
    """One sequence of the tokens ``ids`` in page 0 of each group (state slot 0, from zeros),
    logits at the rows ``logits_indices``."""
    T = len(ids)
    return ForwardBatch(
        input_ids=jnp.asarray(ids, jnp.int32),
        positions=jnp.arange(T, dtype=jnp.int32),
        cu_q_lens=jnp.array([0, T], jnp.int32),
        kv_lens=jnp.array([T], jnp.int32),
        num_seqs=jnp.int32(1),
        page_tables={g: jnp.zeros((1, 1), jnp.int32) for g in groups},
        slot_mappings={g: jnp.arange(T, dtype=jnp.int32) for g in groups},
        state_slots=jnp.zeros((1,), jnp.int32),
        has_initial_state=jnp.zeros((1,), bool),
        logits_indices=jnp.asarray(logits_indices, jnp.int32),
    )
