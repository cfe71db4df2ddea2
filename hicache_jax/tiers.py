"""The three cache tiers a prefix's pages come from (JAX-free; every layer shares it).

``DEVICE`` is L1 (the device pool), ``HOST`` L2 (pinned host memory), ``STORAGE`` L3 (the
TensorStore store many servers share). A request's ``cached_tokens_details``, a match's
page tiers, the metrics' ``tier`` label and the benchmark's reports all count per tier in
this order. ``StrEnum`` members compare and hash as their strings, so JSON, metric labels and
SGLang-shaped responses keep the plain names.
"""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    DEVICE = "device"  # L1: pages in the device pool
    HOST = "host"  # L2: copies in host memory
    STORAGE = "storage"  # L3: pages read from the shared store


TIERS = tuple(Tier)


def zero_counts() -> dict[Tier, int]:
    """A token count per tier, all zero (the shape of ``cached_tokens_details``)."""
    return dict.fromkeys(TIERS, 0)
