"""The decode step's KV bytes on TPU with quantized pages (``--kv_cache_dtype``), measured
without a chip.

    python benchmarks/tpu_kv_quant.py [--family llama-3-8b] [--num_layers 2]
        [--topology v6e:2x4] [--batch 64] [--context 2048]
        [--kv_cache_dtypes bfloat16,float8_e4m3fn,float8_e5m2,int8]

For each KV dtype the decode step (``--batch`` sequences at ``--context`` tokens, one chip,
bfloat16 weights, the Pallas kernels) is compiled for the slice (``hicache_jax/tpu``) and
reports: the KV pool's bytes per token; the KV bytes the step's Pallas calls declare (the
attention kernels read each sequence's pages, the KV writes store the new rows: the
``CostEstimate`` that ``cost_analysis`` adds up); the step's HBM bytes from the scheduled HLO
(``hicache_jax/tpu/hbm.py``) and ``cost_analysis``'s bytes accessed; each against the first
dtype's.
"""

from __future__ import annotations

import argparse
import json
import re

from hicache_jax.config import EngineConfig
from hicache_jax.tpu.abstract import AbstractServer
from hicache_jax.tpu.configs import HF_CONFIGS, real_config
from hicache_jax.tpu.hbm import hbm_bytes
from hicache_jax.tpu.planner import step_cost
from hicache_jax.tpu.target import target


def kernel_bytes(compiled) -> int:
    """The ``bytes_accessed`` every Pallas call of the program declares, summed."""
    found = re.findall(r'\\?"cost_estimate\\?":\s*(\{[^}]*\})', compiled.as_text())
    return sum(int(json.loads(m.replace('\\"', '"'))["bytes_accessed"]) for m in found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama-3-8b", choices=sorted(HF_CONFIGS))
    ap.add_argument("--num_layers", type=int, default=2, help="0: the whole model")
    ap.add_argument("--topology", default="v6e:2x4")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--kv_cache_dtypes", default="bfloat16,float8_e4m3fn,float8_e5m2,int8")
    a = ap.parse_args()
    mc = real_config(a.family, a.num_layers or None)
    print(
        f"{a.family} ({mc.num_layers} layers) on {a.topology}, tp 1, bfloat16 weights, decode x{a.batch} "
        f"at {a.context} tokens, page {a.page_size}; ratios against the first dtype"
    )
    head = [("pool B/token", 13), ("kernel KV MiB", 14), ("ratio", 7), ("step HBM MiB", 13)]
    head += [("ratio", 7), ("cost MiB", 10)]
    print(f"{'kv dtype':<15}" + "".join(f"{n:>{w}}" for n, w in head))
    base = None
    for kv in a.kv_cache_dtypes.split(","):
        cfg = EngineConfig(
            dtype="bfloat16",
            kv_cache_dtype=kv,
            tp_size=1,
            page_size=a.page_size,
            context_length=a.context,
            max_running_requests=a.batch,
            max_total_tokens=a.batch * a.context,
        )
        server = AbstractServer.build(mc, cfg, target(a.topology))
        compiled = server.compile_step((a.batch, a.batch, a.batch, True))
        per_token = server.cache_bytes_by_kind()["kv"] / cfg.max_total_tokens
        kvb, hbm = kernel_bytes(compiled), hbm_bytes(compiled)
        cost = step_cost(compiled).get("bytes accessed", 0.0)
        base = base or (kvb, hbm)
        print(
            f"{kv:<15}{per_token:>13.0f}{kvb / 2**20:>14.1f}{kvb / base[0]:>7.3f}"
            f"{hbm / 2**20:>13.1f}{hbm / base[1]:>7.3f}{cost / 2**20:>10.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
