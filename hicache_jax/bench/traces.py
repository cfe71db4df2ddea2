"""Mooncake-format request traces: read them, and turn their hash ids into token ids.

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

Each hash id stands for one block of ``block_size`` prompt tokens (512 in the published
traces), so a line has ``ceil(input_length / block_size)`` of them; two requests that
start with the same hash ids share that prefix. As in Mooncake (a rolling hash over the
blocks), one id is one content: always a full block, except that a prompt's last, partial
block has an id of its own, which a longer prompt extending that content does not reuse
(its full block gets another id). ``read_trace`` refuses a trace that gives one id two
lengths, as a replayer that materializes each id once would.

Replaying on a small machine scales a block down (``tokens_per_block``, e.g. 16), which
keeps the sharing structure and shrinks every length by the same factor. The tokens of a
block are a pure function of its hash id, so two replays (or two servers) build identical
prompts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator

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


def read_trace(
    path: str, max_requests: int | None = None, *, block_size: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """The trace's requests, checked line by line: ``ceil(input_length / block_size)`` hash
    ids, and each id one block length throughout (``TraceError`` names the first line that
    breaks either)."""
    out = []
    seen: dict[int, tuple[int, int]] = {}  # hash id -> (its block's length, first line)
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
            _check_blocks(req, block_size, seen, path, lineno)
            out.append(req)
            if max_requests is not None and len(out) >= max_requests:
                break
    return out


def _check_blocks(
    req: TraceRequest, block_size: int, seen: dict[int, tuple[int, int]], path: str, lineno: int
) -> None:
    where = f"{path}:{lineno}"
    want = math.ceil(req.input_length / block_size)
    if len(req.hash_ids) != want:
        raise TraceError(
            f"{where}: {len(req.hash_ids)} hash_ids for input_length {req.input_length}, "
            f"{block_size}-token blocks need {want}"
        )
    for i, h in enumerate(req.hash_ids):
        n = min(block_size, req.input_length - i * block_size)
        first = seen.setdefault(h, (n, lineno))
        if first[0] != n:
            raise TraceError(
                f"{where}: hash_id {h} is a block of {n} tokens here "
                f"but of {first[0]} tokens at line {first[1]}"
            )


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


class _History:
    """A conversation's tokens as Mooncake blocks: full blocks' ids and the partial tail's
    length. A prompt's last, partial block gets a one-off id; once more tokens fill that
    block, the full block gets a fresh id::

        turn 1 prompt   | 0 | 1 | 2 | 3 | 7 |8'|           8' = one-off id, 8 is never reused
        reply, turn 2   | 0 | 1 | 2 | 3 | 7 | 9 |10 |11'|  9 = block 8' completed
    """

    def __init__(self, system: list[int], new_id: Callable[[], int]):
        self.full = list(system)
        self.tail = 0  # tokens after the last full block
        self.new_id = new_id

    def extend(self, tokens: int) -> None:
        self.tail += tokens
        while self.tail >= MOONCAKE_BLOCK_TOKENS:
            self.full.append(self.new_id())
            self.tail -= MOONCAKE_BLOCK_TOKENS

    @property
    def length(self) -> int:
        return len(self.full) * MOONCAKE_BLOCK_TOKENS + self.tail

    def prompt_hash_ids(self) -> list[int]:
        return self.full + ([self.new_id()] if self.tail else [])


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
    shared system prompts (``system_blocks`` full blocks) and every turn appends the
    user's message (``turn_blocks`` blocks' worth of tokens, the last block partial) and then the
    model's reply to the session's history, so a turn's prompt extends the previous turn's
    prompt and reply. Lines are yielded in timestamp order."""
    B = MOONCAKE_BLOCK_TOKENS
    rng = random.Random(seed)
    next_id = 0

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    systems = [[new_id() for _ in range(system_blocks)] for _ in range(num_systems)]
    events = []
    for _ in range(sessions):
        history = _History(rng.choice(systems), new_id)
        t = rng.uniform(0, gap_ms[1] * turns / 4)
        for _ in range(turns):
            history.extend((rng.randint(*turn_blocks) - 1) * B + rng.randint(1, B))  # the user's message
            out_len = rng.randint(*reply_tokens)
            events.append(
                {
                    "timestamp": round(t),
                    "input_length": history.length,
                    "output_length": out_len,
                    "hash_ids": history.prompt_hash_ids(),
                }
            )
            history.extend(out_len)  # the reply joins the history
            t += rng.uniform(*gap_ms)
    events.sort(key=lambda e: e["timestamp"])
    yield from events


def write_trace(path: str, events: Iterable[dict]) -> None:
    with open(path, "w") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")


def main(argv: list[str] | None = None) -> None:
    """``python -m hicache_jax.bench.traces --out FILE [--sessions N --turns T --seed S]``: write a
    synthetic conversation trace in Mooncake's format."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_trace(args.out, synth_conversations(sessions=args.sessions, turns=args.turns, seed=args.seed))


if __name__ == "__main__":
    main()
