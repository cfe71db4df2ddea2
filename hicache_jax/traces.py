"""Mooncake-format request traces: read them, and turn their hash ids into token ids.

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

Each hash id stands for one block of ``block_tokens`` prompt tokens (512 in the published
traces); two requests that start with the same hash ids share that prefix. Replaying on a
small machine scales a block down (``tokens_per_block``, e.g. 16), which keeps the sharing
structure and shrinks every length by the same factor. The tokens of a block are a pure
function of its hash id, so two replays (or two servers) build identical prompts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """A malformed trace line; the message names the line."""


def read_trace(path: str, max_requests: int | None = None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                req = TraceRequest(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{lineno}: not a Mooncake trace line ({e})") from None
            if req.input_length <= 0 or req.output_length < 0 or not req.hash_ids:
                raise TraceError(f"{path}:{lineno}: needs input_length > 0 and some hash_ids")
            out.append(req)
            if max_requests is not None and len(out) >= max_requests:
                break
    return out


def block_tokens(hash_id: int, n: int, vocab: tuple[int, int]) -> list[int]:
    """The ``n`` token ids standing for one block (deterministic in ``hash_id``)."""
    rng = np.random.default_rng(hash_id)
    return rng.integers(vocab[0], vocab[1], n).tolist()


def prompt_ids(
    req: TraceRequest,
    *,
    tokens_per_block: int,
    vocab: tuple[int, int],
    block_tokens_in_trace: int = MOONCAKE_BLOCK_TOKENS,
) -> list[int]:
    """The prompt of a trace request, scaled to ``tokens_per_block`` tokens per block: its
    blocks in order, cut to the scaled input length (the last block may be partial)."""
    scale = tokens_per_block / block_tokens_in_trace
    n = max(1, min(math.ceil(req.input_length * scale), len(req.hash_ids) * tokens_per_block))
    ids: list[int] = []
    for h in req.hash_ids:
        if len(ids) >= n:
            break
        ids += block_tokens(h, tokens_per_block, vocab)
    return ids[:n]


def scaled_output_length(
    req: TraceRequest, *, tokens_per_block: int, block_tokens_in_trace: int = 512
) -> int:
    return max(1, math.ceil(req.output_length * tokens_per_block / block_tokens_in_trace))


def synth_conversations(
    *,
    sessions: int,
    turns: int,
    seed: int = 0,
    system_blocks: int = 4,
    num_systems: int = 3,
    turn_blocks: tuple[int, int] = (1, 6),
    reply_tokens: tuple[int, int] = (32, 600),
    gap_ms: tuple[float, float] = (500, 20000),
) -> Iterator[dict]:
    """A conversation trace in Mooncake's format: each session starts from one of a few
    shared system prompts and every turn appends the user's blocks and the model's reply to
    the session's history (so a turn's prompt extends the previous turn's). Lines are
    yielded in timestamp order."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + k))
        next_id += k
        return ids

    systems = [fresh(system_blocks) for _ in range(num_systems)]
    events = []
    for _ in range(sessions):
        history = list(rng.choice(systems))
        t = rng.uniform(0, gap_ms[1] * turns / 4)
        for _ in range(turns):
            history += fresh(rng.randint(*turn_blocks))
            out_len = rng.randint(*reply_tokens)
            in_len = (len(history) - 1) * MOONCAKE_BLOCK_TOKENS + rng.randint(1, MOONCAKE_BLOCK_TOKENS)
            events.append(
                {
                    "timestamp": round(t),
                    "input_length": in_len,
                    "output_length": out_len,
                    "hash_ids": list(history),
                }
            )
            history += fresh(max(1, out_len // MOONCAKE_BLOCK_TOKENS + 1))  # the reply joins the history
            t += rng.uniform(*gap_ms)
    events.sort(key=lambda e: e["timestamp"])
    yield from events
