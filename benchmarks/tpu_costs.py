"""How close the compiled TPU step comes to its floors, measured without a chip.

    python benchmarks/tpu_costs.py [--families mistral-7b,gemma-3-4b,...] [--num_layers 4]
                                   [--topology v5e:2x2 --tp_size 4] [--context 2048]

For each family (published widths, ``--num_layers`` deep; 0: the whole model) the step is
compiled for the slice with the Pallas backends (``hicache_jax/tpu/abstract.py``), and the
compiled program's own ``cost_analysis`` (per chip) is set against:

- decode at batch 8 and 64, every sequence at ``--context`` tokens: HBM bytes accessed over
  the minimum, the weights read once (of an embedding table that is not the output layer
  too, the batch's rows) plus each sequence's live KV (its window, in sliding layers) read
  once, and its recurrent state read once and written once (a decode step must store the
  new state: the one write a floor cannot leave out); for latent attention, each sequence's
  latent rows (at most ``index_topk`` of them in a sparse layer) and its indexer keys;
- one prefill chunk (``--chunk`` tokens of one new sequence): flops over the analytic count
  of ``benchmarks/floors.py`` divided over the chips;
- for each of those programs and for the prefill program that reports every row's top
  logprobs (``--chunk`` + 32 rows, 32 sequences, top 20): HBM temporaries
  (``memory_analysis``) over the chip's cache (KV pages and recurrent state) at
  ``--max_total_tokens``.

"in HBM" counts only what lies in HBM, from the scheduled HLO (``hicache_jax/tpu/hbm.py``):
``cost_analysis`` also counts every VMEM prefetch and every read of the prefetched copy.
The Pallas kernels' bytes and flops are theirs as declared by ``pl.CostEstimate`` (counted
from their block specs and DMA sizes, at the static shapes: a decode sequence is assumed to
read ``--context`` tokens); the rest is XLA's count of the fused HLO.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax.numpy as jnp  # noqa: E402
from floors import step_flops  # noqa: E402

from hicache_jax.config import EngineConfig  # noqa: E402
from hicache_jax.models.sharding import kv_heads_on_device  # noqa: E402
from hicache_jax.tpu.abstract import AbstractServer  # noqa: E402
from hicache_jax.tpu.configs import HF_CONFIGS, real_config  # noqa: E402
from hicache_jax.tpu.hbm import hbm_bytes  # noqa: E402
from hicache_jax.tpu.planner import step_cost  # noqa: E402
from hicache_jax.tpu.target import target  # noqa: E402


def min_decode_bytes(server: AbstractServer, batch: int, context: int) -> float:
    """Weights once, plus each sequence's live KV once and its state read and written once,
    on one chip. An embedding table that is not also the output layer is read only at the
    batch's rows."""
    cfg, tp = server.model.cfg, server.cfg.tp_size
    b = jnp.dtype(server.model.dtype).itemsize
    kv_token = 2 * (kv_heads_on_device(cfg, tp) // tp if tp > 1 else cfg.num_kv_heads) * cfg.head_dim * b
    total = float(server.weights_bytes())
    if not cfg.tie_word_embeddings:
        total -= server.embedding_bytes() - batch * cfg.hidden_size * b
    for kind in cfg.layer_kinds:
        if kind in ("mamba", "gdn"):
            (conv, _), (ssm, _) = cfg.state_shapes(kind)
            state = math.prod(ssm) * 4 / tp + math.prod(conv) * b
            total += 2 * batch * state  # read, and the step's new state written back
        elif kind in ("mla", "dsa", "dsa_shared"):  # one latent row per token, on every chip
            m = cfg.mla
            live = min(context, m.index_topk) if kind != "mla" and m.index_topk else context
            total += batch * live * m.latent_dim * b
            if kind == "dsa":  # the indexer scores every key
                total += batch * context * m.index_head_dim * b
        else:
            live = min(context, cfg.sliding_window) if kind == "sliding" else context
            total += batch * live * kv_token
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="mistral-7b,llama-3-8b,gemma-3-4b,gemma-3-27b,bamba-9b")
    ap.add_argument("--num_layers", type=int, default=4, help="0: the whole model")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--tp_size", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--max_total_tokens", type=int, default=65536)
    a = ap.parse_args()
    tgt = target(a.topology)
    print(f"{a.topology} at tp {a.tp_size}, bfloat16, decode sequences at {a.context} tokens, per chip")
    head = [("layers", 7), ("step", 11), ("HBM MiB", 10), ("min MiB", 10), ("ratio", 7), ("in HBM", 7)]
    head += [("GFLOP", 9), ("floor", 9), ("temp MiB", 10), ("temp/cache", 11)]
    print(f"{'family':<13}" + "".join(f"{n:>{w}}" for n, w in head))
    for family in a.families.split(","):
        assert family in HF_CONFIGS, f"unknown family {family}; known: {sorted(HF_CONFIGS)}"
        mc = real_config(family, a.num_layers or None)
        cfg = EngineConfig(
            dtype="bfloat16",
            tp_size=a.tp_size,
            chunked_prefill_size=a.chunk,
            context_length=a.context,
            max_running_requests=64,
            max_total_tokens=a.max_total_tokens,
        )
        server = AbstractServer.build(mc, cfg, tgt)
        cache = server.cache_bytes()

        def temps(compiled, cache=cache) -> str:
            t = compiled.memory_analysis().temp_size_in_bytes
            return f"{t / 2**20:>10.1f}{t / cache:>11.3f}"

        for batch in (8, 64):
            compiled = server.compile_step((batch, batch, batch, True))
            cost = step_cost(compiled)
            need = min_decode_bytes(server, batch, a.context)
            got = cost.get("bytes accessed", 0.0)
            print(
                f"{family:<13}{mc.num_layers:>7}{'decode x' + str(batch):>11}{got / 2**20:>10.0f}"
                f"{need / 2**20:>10.0f}{got / need:>7.2f}{hbm_bytes(compiled) / need:>7.2f}"
                f"{'':>9}{'':>9}{temps(compiled)}",
                flush=True,
            )
        chunk = a.chunk
        compiled = server.compile_step((chunk, 1, 1, False))
        cost = step_cost(compiled)
        floor = step_flops(mc, [(chunk, chunk)], logits_rows=1) / a.tp_size
        got = cost.get("flops", 0.0)
        print(
            f"{family:<13}{mc.num_layers:>7}{'prefill':>11}{'':>10}{'':>10}{got / floor:>7.2f}{'':>7}"
            f"{got / 1e9:>9.1f}{floor / 1e9:>9.1f}{temps(compiled)}",
            flush=True,
        )
        rows = chunk + 32
        compiled = server.compile_step((rows, 32, rows, False), top_logprobs=20)
        print(f"{family:<13}{mc.num_layers:>7}{'logprobs':>11}{'':>61}{temps(compiled)}", flush=True)


if __name__ == "__main__":
    main()
