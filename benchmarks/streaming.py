"""Cost per streamed chunk over a long output: the old cumulative path against the delta path.

    python benchmarks/streaming.py [--tokens 4000] [--window 100] [--top 5]

No model runs: a request's output grows by one token per step (the tiny preset's byte-level
tokenizer, text with multi-byte characters) and each step is streamed the way the server does:

  old  the engine loop formats the whole output (decode of every id, a logprob triple per
       token), then the /generate handler encodes all of it as JSON; the OpenAI handler diffs
       the cumulative text and slices the new logprobs off the whole list.
  new  the engine loop makes an ``OutputDelta`` (incremental detokenizer, logprobs of the new
       token); /generate appends it to pre-encoded JSON (``CumulativeStream``), OpenAI formats
       the delta alone.

Reported: median microseconds per chunk over the first and the last ``--window`` tokens
(medians, as the machine may be busy with other work). A flat path has last/first near 1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hicache_jax.engine.outputs import OutputStream, format_output
from hicache_jax.models.presets import TOKENIZER
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.request import Req
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.server.openai_api import completion_logprobs
from hicache_jax.server.streaming import CumulativeStream, sse

WORDS = ["cache", "page", "tier", "radix", "世界", "😀", "naïve", "→", "token", "L3", "\n"]


class OldTextDelta:
    """The server's former OpenAI text diff over cumulative text (kept here to compare)."""

    def __init__(self):
        self.sent = ""

    def update(self, text: str) -> str:
        text = (text or "").rstrip("\ufffd")
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def token_stream(tok: Tokenizer, n: int) -> list[int]:
    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" ".join(rng.choice(WORDS) for _ in range(200)), add_special_tokens=False)
    return ids[:n]


def new_request(top: int) -> Req:
    return Req("bench", [1, 2, 3], SamplingParams(), return_logprob=top > 0, top_logprobs_num=top)


def grow(req: Req, tok_id: int, n: int, top: int) -> None:
    req.output_ids.append(tok_id)
    tops = [(-0.1 * (k + 1), (tok_id + k) % 500) for k in range(top)] if top else None
    req.output_logprobs.append((-0.01 * (n % 100), tops))


def run(path: str, ids: list[int], tok: Tokenizer, top: int, window: int) -> tuple[float, float]:
    """Median seconds per chunk over the first and the last ``window`` tokens. The old paths
    keep no state between chunks but the text sent, so the chunks in between are skipped."""
    req = new_request(top)
    stream, cumulative, old_delta, sent, n_tok = (
        OutputStream(req, tok),
        CumulativeStream(),
        OldTextDelta(),
        0,
        0,
    )
    timed = set(range(window)) | set(range(len(ids) - window, len(ids)))
    times = []
    for n, t in enumerate(ids):
        grow(req, t, n, top)
        if path.startswith("old") and n not in timed:
            continue
        if n == len(ids) - window:  # the old OpenAI diff resumes with the text sent so far
            old_delta.sent, n_tok = tok.decode(req.output_ids[:n]).rstrip("\ufffd"), n
        t0 = time.perf_counter()
        if path == "old /generate":
            sse(format_output(req, tok))
        elif path == "new /generate":
            cumulative.event(stream.next(req))
        elif path == "old openai":
            out = format_output(req, tok)
            offset = len(old_delta.sent)
            text = old_delta.update(out["text"])
            meta = out["meta_info"]
            triples = meta.get("output_token_logprobs", [])[n_tok:]
            tops = meta.get("output_top_logprobs", [None] * len(req.output_ids))[n_tok:]
            sse(
                {
                    "choices": [
                        {"index": 0, "text": text, "logprobs": completion_logprobs(triples, tops, offset)}
                    ]
                }
            )
            n_tok = len(req.output_ids)
        elif path == "new openai":
            d = stream.next(req)
            text = d.text or ""
            lps = completion_logprobs(d.logprobs or [], d.top_logprobs, sent)
            sse({"choices": [{"index": 0, "text": text, "logprobs": lps}]})
            sent += len(text)
        if n in timed:
            times.append(time.perf_counter() - t0)
    return statistics.median(times[:window]), statistics.median(times[-window:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--top", type=int, default=5, help="top logprobs per token (0: no logprobs)")
    args = ap.parse_args()
    tok = Tokenizer(TOKENIZER)
    ids = token_stream(tok, args.tokens)
    w = args.window
    print(
        f"{args.tokens} tokens, logprobs {'with top ' + str(args.top) if args.top else 'off'}; us per chunk"
    )
    print(f"{'path':<16}{'tokens 0-' + str(w):>14}{f'{args.tokens - w}-{args.tokens}':>14}{'last/first':>12}")
    for path in ("old /generate", "new /generate", "old openai", "new openai"):
        first, last = (x * 1e6 for x in run(path, ids, tok, args.top, w))
        print(f"{path:<16}{first:>14.1f}{last:>14.1f}{last / first:>12.1f}")


if __name__ == "__main__":
    main()
