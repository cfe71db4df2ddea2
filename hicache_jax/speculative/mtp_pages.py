"""Pages for multi-token-prediction drafts: a step's MTP block chains its next draft one
position at a time after each sequence's last token, writing its KV there
(``runtime/mtp_drafts.py``), so each sampling request of the step holds pages up to
``steps - 1`` positions past the step's end where the pool has them free. Taken without
retracting anyone: a request without them drafts shorter (the chain stops where its pages
do). Those positions are the next step's first rows, which write them again."""

from __future__ import annotations

from hicache_jax.scheduler.cache_adapter import CacheAdapter
from hicache_jax.scheduler.plan import StepPlan


def reserve_chain(plan: StepPlan, adapter: CacheAdapter, steps: int, context_len: int) -> None:
    for item in plan.items:
        if item.samples and steps > 1:
            adapter.ensure_pages(item.req, min(item.end + steps - 1, context_len))
