"""One request's state as the scheduler sees it."""

from __future__ import annotations

import dataclasses
import enum
import time

from hicache_jax.sampling_params import SamplingParams
from hicache_jax.tiers import zero_counts

PLACEHOLDER = (
    0  # fill_ids' stand-in for a token still on the device (never fed: see runtime/batch_builder.py)
)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class ReqCache:
    """One request's hold on the cache (``scheduler/cache_adapter.py`` keeps it; the batch
    builder reads it). Page ``j`` of each paged kind is borrowed from the radix tree or the
    request's own (``own``: it frees it); a recurrent layer's working state lives in
    ``state_slot``, and its snapshots wait in ``snapshots`` until the tree takes them."""

    # Per paged cache kind the model keeps (None where the page was freed), one entry per
    # page of the sequence so far; every kind's list has the same length.
    pages: dict = dataclasses.field(default_factory=dict)
    own: dict = dataclasses.field(default_factory=dict)
    state_slot: int | None = None  # working recurrent state (every recurrent layer)
    restore_from: int | None = None  # snapshot slot to copy into state_slot before the next step
    snapshots: dict = dataclasses.field(default_factory=dict)  # page count -> snapshot slot
    # Scratch state slots of a verify step in flight (speculative decoding): the state after
    # each draft position, until the accepted one becomes ``state_slot`` (``after_verify``).
    trail: list = dataclasses.field(default_factory=list)
    # The same for a page-state kind (``kinds.PAGE_STATE``): per kind, a scratch page per
    # draft position, until the accepted one replaces the current page's (``after_verify``).
    trail_pages: dict = dataclasses.field(default_factory=dict)
    last_node: object = None  # deepest radix node this request locks
    window_locked: list = dataclasses.field(default_factory=list)  # nodes whose window pages it pins
    num_inserted_pages: int = 0  # pages of fill_ids already in the tree

    @property
    def num_pages(self) -> int:
        return max((len(p) for p in self.pages.values()), default=0)

    def owned(self, kind: str) -> list[int]:
        """The indices of ``kind`` the request frees."""
        return [p for p, o in zip(self.pages.get(kind, ()), self.own.get(kind, ())) if o and p is not None]


@dataclasses.dataclass(eq=False)  # a request is itself: compared (and removed from lists) by identity
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs
    top_logprobs_num: int = 0
    cache_salt: str | None = None
    seed: int = 0  # resolved sampling seed (the request's, or drawn at arrival)
    stream: bool = False
    prefetch_key: str = ""  # the L3 prefetch task's key: unique per request, even if rid repeats
    # Another choice of the same prompt (n > 1): this one is admitted only once that one has
    # computed the prompt, so it finds the prompt's pages in the tree (``Scheduler``).
    after: Req | None = None
    # The parent request of the n choices of one ``n > 1`` request (its rid as the server
    # names it); None for a request of its own.
    group: str | None = None
    grammar: object = None  # its ``grammar.constraint.Constraint``, when the output is constrained
    # Prefill/decode disaggregation, on a decode server: what became of the prompt's handover
    # through L3 (``server/disaggregation.py``; meta_info "disaggregation"). With status
    # "handover" a prefill server wrote the pages: L3 is read whatever the prefetch threshold,
    # and waited for under every prefetch policy up to the read's own deadline.
    handover: dict | None = None

    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: dict | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Where the time to the first token went, in seconds, set once each (meta_info "timing"):
    # l3_probe_s / l3_read_s (its L3 prefetch's existence checks and page reads),
    # l3_landed_s (arrival to the read's results taken by the scheduler), admitted_s
    # (arrival to admission), l2_load_s (host -> device copies at admission, host time);
    # over HTTP, loop_wait_s (the request queued for the engine thread, before its arrival).
    timing: dict = dataclasses.field(default_factory=dict)

    # What it holds in the cache: one object that only the scheduler's cache adapter changes.
    cache: ReqCache = dataclasses.field(default_factory=lambda: ReqCache())
    num_computed: int = 0  # tokens of fill_ids whose KV/state is in the cache
    cached_tokens: int = 0
    cached_details: dict = dataclasses.field(default_factory=zero_counts)  # tokens per Tier
    penalty_slot: int | None = None  # its row of the device's penalty counts (the engine's)
    retractions: int = 0
    held_steps: int = 0  # steps it waited for a running request computing a shared prefix
    queued_steps: int = 0  # scheduling rounds it has waited (the lpm policy's age bound)
    computed_before: int = 0  # most tokens it had computed itself before a retraction
    loaded_tiers: list = dataclasses.field(default_factory=list)  # see CacheAdapter._count_cached
    # Tokens sampled by a step still in flight (the overlap schedule): their ids are on the
    # device, so ``fill_ids`` holds a placeholder for each until the step's results are read.
    pending: int = 0
    # Speculative decoding: its drafter's state (``hicache_jax/speculative``), the verify
    # steps that fed it a draft, the draft tokens accepted, and how often its drafts are
    # right (``scheduler/draft_policy.DraftHistory``: whether a step should draft).
    drafter_state: object = None
    spec_verifications: int = 0
    spec_accepted_tokens: int = 0
    draft_history: object = None

    # Logprobs.
    input_logprobs: dict = dataclasses.field(default_factory=dict)  # position -> (lp, top)
    output_logprobs: list = dataclasses.field(default_factory=list)  # (lp, top) per output

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids + [PLACEHOLDER] * self.pending

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence so far: prompt, outputs, and outputs still in flight."""
        return len(self.input_ids) + len(self.output_ids) + self.pending

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return self.seq_len - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
