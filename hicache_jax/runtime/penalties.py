"""Repetition, frequency and presence penalties and ``min_new_tokens``, on device.

Definitions (as vLLM applies them, before temperature; the raw logprobs are not changed):

- ``repetition_penalty`` r (CTRL, as in transformers): a token seen in the prompt or the
  output so far has its logit divided by r when positive, multiplied by r when not;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI): then
  ``logit -= f * count + p * (count > 0)``, count = the token's occurrences in the output;
- ``min_new_tokens`` m: until m tokens have been generated, the stop tokens (the model's
  EOS unless ``ignore_eos``, and ``stop_token_ids``) get -inf, so they cannot be drawn.

Counts live on the device, one row per penalty slot (``[slots, V]`` int32, split by
vocabulary as the logits are): the low bits count the token in the output, ``PROMPT_BIT``
marks it seen in the prompt. A request with a penalty holds a slot from its first step to
its end; the engine writes the row from the host's token lists when it (re)assigns the
slot (``seed_row``), and every step adds the token it samples on the device, so the
overlap schedule's unread tokens are counted too. Rows without a slot are untouched, and a
batch without any penalty or ``min_new_tokens`` skips all of this (``lax.cond``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.sampling_params import InvalidRequest

PROMPT_BIT = 1 << 30  # set in a slot's entry for a token of the prompt
COUNT_MASK = PROMPT_BIT - 1
STOP_ID_SLOTS = 16  # stop tokens ``min_new_tokens`` can hold back per request


def held_back(sp, eos_token_ids) -> list[int]:
    """The stop tokens ``min_new_tokens`` holds back for sampling params ``sp``: its
    ``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS tokens."""
    ids = list(dict.fromkeys(list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))))
    if len(ids) > STOP_ID_SLOTS:
        raise InvalidRequest(
            f"sampling_params.min_new_tokens with {len(ids)} stop tokens (stop_token_ids and "
            f"the model's EOS) is not supported: at most {STOP_ID_SLOTS}"
        )
    return ids


def seed_row(prompt_ids, output_ids, vocab: int) -> np.ndarray:
    """[V] int32: a slot's entries for a request with these prompt and output tokens."""
    row = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab)[:vocab].astype(np.int32)
    seen = np.zeros(vocab, bool)
    seen[np.asarray(prompt_ids, np.int64)] = True
    return row | np.where(seen, np.int32(PROMPT_BIT), np.int32(0))


@dataclasses.dataclass(frozen=True)
class PenaltyInputs:
    """Per sampled row ([S]); neutral values for rows without a penalty."""

    slots: jax.Array  # [S] int32: the row's penalty slot (-1: none)
    repetition: jax.Array  # [S] float32 (1: off)
    frequency: jax.Array  # [S] float32 (0: off)
    presence: jax.Array  # [S] float32 (0: off)
    min_new_tokens: jax.Array  # [S] int32
    stop_ids: jax.Array  # [S, STOP_ID_SLOTS] int32: tokens held back before min_new_tokens (-1: none)
    # A verify step's row j of a request (speculative decoding) predicts the token after
    # draft tokens 1..j, which its slot's counts do not hold yet: they are counted here on
    # top of the slot's (-1: none). [S, 0] outside verify steps.
    draft_ids: jax.Array
    # Whether the row's sampled token is added to its slot's counts: not on a drafted
    # request's rows, whose accepted tokens the host writes once it has read them.
    counts_sample: jax.Array  # [S] bool

    @classmethod
    def neutral(cls, S: int, drafts: int = 0) -> PenaltyInputs:
        """Host arrays for S rows without any penalty (``drafts``: ``draft_ids``' width)."""
        return cls(
            draft_ids=np.full((S, drafts), -1, np.int32),
            counts_sample=np.ones(S, bool),
            slots=np.full(S, -1, np.int32),
            repetition=np.ones(S, np.float32),
            frequency=np.zeros(S, np.float32),
            presence=np.zeros(S, np.float32),
            min_new_tokens=np.zeros(S, np.int32),
            stop_ids=np.full((S, STOP_ID_SLOTS), -1, np.int32),
        )


jax.tree_util.register_dataclass(
    PenaltyInputs, data_fields=[f.name for f in dataclasses.fields(PenaltyInputs)], meta_fields=[]
)


def penalised(logits_s: jax.Array, p: PenaltyInputs, counts: jax.Array, generated: jax.Array) -> jax.Array:
    """logits_s [S, V] raw logits; counts [slots, V]; generated [S] tokens each row has
    generated so far -> [S, V] the logits the row's token is chosen from. The same array
    when no row has a penalty or holds back stop tokens."""

    def apply(x):
        slot = p.slots
        row = jnp.where((slot >= 0)[:, None], counts[jnp.maximum(slot, 0)], 0)  # [S, V]
        if p.draft_ids.shape[1]:  # a verify step: the draft tokens before each row count too
            rows = jnp.broadcast_to(jnp.arange(row.shape[0])[:, None], p.draft_ids.shape)
            ids = jnp.where(p.draft_ids >= 0, p.draft_ids, row.shape[-1])  # out of range: dropped
            row = row.at[rows, ids].add(1, mode="drop")
        n = (row & COUNT_MASK).astype(jnp.float32)
        r = p.repetition[:, None]
        x = jnp.where(row != 0, jnp.where(x > 0, x / r, x * r), x)
        x = x - p.frequency[:, None] * n - p.presence[:, None] * (n > 0)
        hold = (generated < p.min_new_tokens)[:, None] & (p.stop_ids >= 0)  # [S, L]
        rows = jnp.broadcast_to(jnp.arange(x.shape[0])[:, None], p.stop_ids.shape)
        ids = jnp.where(hold, p.stop_ids, x.shape[-1])  # out of range: dropped
        return x.at[rows, ids].set(-jnp.inf, mode="drop")

    on = (p.slots >= 0).any() | (generated < p.min_new_tokens).any()
    return jax.lax.cond(on, apply, lambda x: x, logits_s)


def counted(counts: jax.Array, p: PenaltyInputs, next_ids: jax.Array) -> jax.Array:
    """``counts`` with each row's sampled token added to its slot (rows without one:
    nothing; a batch without slots: the same array)."""

    def add(c):
        slot = jnp.where((p.slots >= 0) & p.counts_sample, p.slots, c.shape[0])  # out of range: dropped
        return c.at[slot, next_ids].add(1, mode="drop")

    return jax.lax.cond((p.slots >= 0).any(), add, lambda c: c, counts)


@functools.partial(jax.jit, static_argnames=("sharding",), donate_argnums=(0,))
def _write_row(counts: jax.Array, slot: jax.Array, row: jax.Array, *, sharding=None) -> jax.Array:
    out = jax.lax.dynamic_update_slice_in_dim(counts, row[None].astype(counts.dtype), slot, 0)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def write_row(counts: jax.Array, slot: int, row: np.ndarray, sharding=None) -> jax.Array:
    """``counts`` (donated) with slot ``slot`` set to ``row``: one program for every slot."""
    return _write_row(counts, np.int32(slot), row, sharding=sharding)


def lower_write_row(counts, row: np.ndarray, sharding=None) -> jax.stages.Lowered:
    return _write_row.lower(counts, np.int32(0), row, sharding=sharding)


class Slots:
    """Which request holds which penalty slot: held from a request's first step to its end,
    through retractions (its counts stay valid while it waits). When every slot is held, a
    request that is not in the step gives its slot up, and gets a fresh row from the host's
    token lists when it runs again: the running requests never hold more slots than there are
    (the runner has one per sequence a step can hold)."""

    def __init__(self, n: int):
        self.n = n
        self.holders: dict[int, object] = {}

    def assign(self, req, stepping: set) -> int:
        """A slot for ``req`` (which holds none), taken from a holder not in ``stepping``
        when none is free; the caller writes its row."""
        free = next((i for i in range(self.n) if i not in self.holders), None)
        if free is None:
            free = next((i for i, r in self.holders.items() if r not in stepping), None)
            if free is None:
                raise RuntimeError(f"all {self.n} penalty slots are held by requests in this step")
            self.holders.pop(free).penalty_slot = None
        self.holders[free] = req
        req.penalty_slot = free
        return free

    def assign_all(self, reqs: list, write_row, vocab: int) -> None:
        """A slot, its counts written by ``write_row(slot, row)``, for each request of a
        step (``reqs``) that has a penalty and no slot."""
        stepping = set(reqs)
        for req in reqs:
            if req.sampling.penalised and req.penalty_slot is None:
                assert not req.pending, "a request with tokens in flight already has its slot"
                slot = self.assign(req, stepping)
                write_row(slot, seed_row(req.input_ids, req.output_ids, vocab))

    def release(self, req) -> None:
        if req.penalty_slot is not None:
            self.holders.pop(req.penalty_slot, None)
            req.penalty_slot = None

    def reset(self) -> None:
        """Forget every holder (the device's counts were rebuilt empty)."""
        for req in self.holders.values():
            req.penalty_slot = None
        self.holders.clear()
