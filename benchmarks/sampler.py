"""Token choice: the whole-vocabulary reference against the bounded sampler, side by side.

Times ``sampler_reference.next_tokens`` and ``sampler.next_tokens`` (keys included, logprobs
left out: they are the same code in both) on the same logits and settings, alternating the
two on every repetition so a busy machine slows both alike, and checks they pick the same
tokens. ``sort rows`` is the share of rows the bounded sampler sent to the reference (its
whole-vocabulary search, per row).

Logits are Gaussian with a per-row scale: 6 ("peaked", about 2.5 nats of entropy, a 0.9
nucleus of ~25 tokens, like a language model at temperature 1) or 2 ("flat", a 0.9 nucleus
of ~7600 tokens, past the candidate set, so every top-p row takes the reference: the worst case).

    python benchmarks/sampler.py [--vocab 32000] [--batches 1,8,32,64] [--reps 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.runtime import sampler, sampler_reference
from hicache_jax.runtime.sampler import SamplingInputs

# name -> (logit scale, per-row settings cycled over the batch: (temperature, top_k, top_p, min_p))
CASES = {
    "greedy only": (6.0, [(0.0, -1, 1.0, 0.0)]),
    "mixed": (
        6.0,
        [
            (0.7, 40, 0.9, 0.0),  # batch 1: this row alone
            (0.0, -1, 1.0, 0.0),
            (0.8, -1, 1.0, 0.0),
            (1.0, -1, 0.95, 0.05),
            (1.0, -1, 1.0, 0.1),
        ],
    ),
    "all top-p 0.9": (6.0, [(1.0, -1, 0.9, 0.0)]),
    "all top-p 0.9, flat": (2.0, [(1.0, -1, 0.9, 0.0)]),
}


def make(batch: int, vocab: int, scale: float, rows: list, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray((rng.standard_normal((batch, vocab)) * scale).astype(np.float32))
    t, k, p, m = (np.array([rows[i % len(rows)][j] for i in range(batch)]) for j in range(4))
    s = SamplingInputs(
        last_rows=np.arange(batch, dtype=np.int32),
        temperature=t.astype(np.float32),
        top_p=p.astype(np.float32),
        top_k=k.astype(np.int32),
        min_p=m.astype(np.float32),
        seeds=rng.integers(0, 2**32, batch, dtype=np.uint32),
        counters=rng.integers(0, 1000, batch).astype(np.int32),
        targets=np.zeros(batch, np.int32),
    )
    return logits, jax.tree_util.tree_map(jnp.asarray, s)


def with_keys(next_tokens):
    return jax.jit(lambda logits, s: next_tokens(logits, s, sampler.row_keys(s)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    old, new = with_keys(sampler_reference.next_tokens), with_keys(sampler.next_tokens)
    flagged = jax.jit(functools.partial(sampler._threshold, c=min(sampler.CANDIDATES, args.vocab - 1)))
    print(
        f"vocab {args.vocab}, candidates {sampler.CANDIDATES}, {jax.devices()[0].platform},"
        f" median of {args.reps}"
    )
    print(
        f"{'batch':>5}  {'case':<20} {'reference ms':>12} {'bounded ms':>11} {'speedup':>8} {'sort rows':>10}"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        for name, (scale, rows) in CASES.items():
            logits, s = make(batch, args.vocab, scale, rows)
            a, b = old(logits, s), new(logits, s)  # compile, and the tokens must agree
            if not np.array_equal(a, b):
                raise SystemExit(
                    f"tokens differ at batch {batch}, {name}: {np.asarray(a)} vs {np.asarray(b)}"
                )
            tempered = logits / jnp.maximum(s.temperature, 1e-5)[:, None]
            full = np.asarray(flagged(tempered, s)[1]) & (np.asarray(s.temperature) >= 1e-5)
            times = {old: [], new: []}
            for _ in range(args.reps):
                for f in (old, new):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(logits, s))
                    times[f].append(1e3 * (time.perf_counter() - t0))
            t_old, t_new = statistics.median(times[old]), statistics.median(times[new])
            print(
                f"{batch:>5}  {name:<20} {t_old:>12.2f} {t_new:>11.2f}"
                f" {t_old / t_new:>7.1f}x {full.mean():>10.0%}"
            )


if __name__ == "__main__":
    main()
