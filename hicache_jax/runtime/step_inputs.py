"""One step's inputs as one typed structure (``StepInputs``), and the static shape that picks
its program (``StepShape``). Only ``BatchBuilder.build`` makes them; the runner launches
them, warm-up lowers them, and the multi-host check compares them."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from hicache_jax.models.batch import ForwardBatch
from hicache_jax.runtime.penalties import PenaltyInputs
from hicache_jax.runtime.sampler import SamplingInputs


@dataclasses.dataclass(frozen=True)
class StateCopies:
    """Recurrent state slot copies: ``before`` the forward (restore a snapshot into a working
    slot) and ``after`` it (snapshot a working slot). -1 entries copy nothing."""

    before_src: jax.Array  # [K] int32
    before_dst: jax.Array
    after_src: jax.Array
    after_dst: jax.Array


jax.tree_util.register_dataclass(
    StateCopies, data_fields=["before_src", "before_dst", "after_src", "after_dst"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """What a step's multi-token-prediction drafts need besides the batch
    (``runtime/mtp_drafts.py``). Per token row, the token after it: ``next_ids`` where the
    host knows it (a prompt token), else the id sampled at sampled row ``next_rows`` (-1:
    ``next_ids``). Per sequence: ``draft_rows``, the row after whose token the step samples
    first, and ``draft_lens``, the draft tokens fed after it (a verify step's; the row the
    block drafts from is ``draft_rows`` plus the drafts accepted); ``draft_caps``, the
    positions the sequence has pages for (a chained draft writes the block's KV at the
    positions after its last token, and stops where they end)."""

    next_ids: jax.Array  # [T] int32
    next_rows: jax.Array  # [T] int32
    draft_rows: jax.Array  # [S] int32
    draft_lens: jax.Array  # [S] int32
    draft_caps: jax.Array  # [S] int32


jax.tree_util.register_dataclass(
    DraftInputs,
    data_fields=["next_ids", "next_rows", "draft_rows", "draft_lens", "draft_caps"],
    meta_fields=[],
)


class StepShape(NamedTuple):
    """What picks a step program: ``T`` token rows, ``S`` sequence rows, ``R`` logits rows,
    whether every sequence feeds one token, and ``N`` sampled rows. ``N`` is ``S`` (each
    sequence samples its next token at its last row) except in a verify step, where every
    token row samples (``N = R = T``: the token after each draft token is checked)."""

    T: int
    S: int
    R: int
    decode_only: bool
    N: int = 0  # 0: S

    @property
    def sample_rows(self) -> int:
        return self.N or self.S

    @property
    def verify(self) -> bool:
        return self.N not in (0, self.S)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything one step reads besides the weights, the cache and the penalty counts.

    ``first_rows[i]``: item ``i``'s first token row (its prompt logprobs' first logits row);
    ``sample_rows[i]``: item ``i``'s first sampled row (its next token; a verify item's
    ``len(draft) + 1`` rows start there), or -1 where the item samples nothing."""

    shape: StepShape
    batch: ForwardBatch
    sampling: SamplingInputs
    copies: StateCopies
    penalty: PenaltyInputs
    top_logprobs: int
    first_rows: tuple[int, ...]
    sample_rows: tuple[int, ...]
    draft: DraftInputs | None = None  # None: the step drafts nothing (``runtime/mtp_drafts.py``)

    def with_loads(self, loads) -> StepInputs:
        """These inputs taking ``loads`` (L2 pages written layer by layer, ``ForwardBatch.loads``):
        attached once the step is packed, so a step that fails to pack takes no pages."""
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, loads=loads))
