"""A step's work: ``StepPlan``, the ``WorkItem`` of each request it runs, and the bucket
arithmetic its shapes come from (``token_buckets``, ``TOP_WIDTHS``).

The scheduler makes plans; ``hicache_jax/runtime/batch_builder.py`` turns a plan into padded
device inputs. Nothing here imports JAX, so the scheduler does not either
(``tests/scheduler/test_no_jax.py``).
"""

from __future__ import annotations

import dataclasses

from hicache_jax.request import Req
from hicache_jax.sampling_params import MAX_TOP_LOGPROBS

TOP_WIDTHS = (0, MAX_TOP_LOGPROBS)  # top logprobs a step computes: none, or the most a request may ask


@dataclasses.dataclass
class WorkItem:
    req: Req
    start: int  # first token (index into fill_ids) fed this step
    end: int  # one past the last
    has_initial_state: bool = False
    # Speculative decoding (``scheduler/drafts.py``): tokens proposed after the request's last
    # one, fed after it in this step (``end`` counts them) and checked against what the step
    # samples at each; and per draft token j, the recurrent state slot that receives the
    # state after token j of the step (the state after the last token stays in the working slot).
    draft: tuple[int, ...] = ()
    trail: tuple[int, ...] = ()
    # Whether the step samples this request's next token: fixed when planned, because the
    # request's length grows by that token (``Req.pending``) as soon as the step launches.
    samples: bool = dataclasses.field(init=False)

    def __post_init__(self):
        self.samples = self.end == self.req.seq_len

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def fed_ids(self) -> list[int]:
        """The tokens this step feeds: the request's own, then its draft."""
        return self.req.fill_ids[self.start : self.end - len(self.draft)] + list(self.draft)

    @property
    def wants_input_logprobs(self) -> bool:
        r = self.req
        return r.return_logprob and 0 <= r.logprob_start_len and self.start < r.input_len


@dataclasses.dataclass
class StepPlan:
    items: list[WorkItem]
    copies_before: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    copies_after: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return all(i.num_tokens == 1 for i in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    @property
    def verify(self) -> bool:
        """A verify step: some request feeds a draft (every item is then a decode)."""
        return any(i.draft for i in self.items)


def token_buckets(max_tokens: int) -> list[int]:
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        b *= 4
    return out + [max_tokens]
