"""KV bytes one token leaves in the cache (every layer, bfloat16), for the latent-attention
families against the attention layouts of the same model size, and for DeepSeek V4 pool by
pool.

    python benchmarks/kv_bytes.py

For each published model (``hicache_jax/tpu/configs.py``) and the 100m-mla preset:
- ``this``: what the cache stores (``models/page_bytes.py``, from the layers' declaration):
  MLA's latent and rope key (``kv_lora_rank + qk_rope_head_dim``) per layer, plus a DSA
  layer's indexer key;
- ``GQA-8``: the same layers with grouped-query attention of 8 KV heads of 128 (Llama 3
  405B's and Qwen3's layout at these sizes), K and V;
- ``MHA``: K and V of every query head at the model's own head dims, what MLA's keys and
  values would be if expanded.
Sparse attention reads at most ``index_topk`` latent rows per query, but stores every token's.

DeepSeek V4 (the second and third tables) keeps pools of three retentions
(``hicache_jax/kinds.py``): compressed entries and indexer keys every page keeps (``csa``,
``index``, ``hca``: one row per 4 or 128 tokens), and the window's rows (``swa``: one K=V
row of ``head_dim`` per token) and the compressors' float32 state (``csa_state``,
``hca_state``: one row per page) that a sequence needs only behind its end. So its bytes
per token depend on the context: a sequence of L tokens holds every entry plus the pages
its window covers (``PrefixRules.window_pages``), divided by L. L2 and L3 keep every page's
window rows and state as well (any page boundary may be a later prompt's prefix end). Its
configs are built here from the published numbers: V4 Flash's ``config.json`` (43 layers,
``compress_ratios`` 0, 0, then 4 and 128 alternating), and V4 Pro's attention (61 layers of
Flash's attention widths, 2 HCA then CSA and HCA alternating: 30 CSA, 31 HCA, the layout
vLLM's 9.62 GiB per 1M-token sequence implies; Pro's own widths do not change the KV).
"""

from __future__ import annotations

import argparse
import collections

from hicache_jax.cache.prefix import PrefixRules
from hicache_jax.kinds import L3_SUFFIX, CacheKind, Retention, retention
from hicache_jax.models.cache import layer_specs
from hicache_jax.models.page_bytes import page_bytes
from hicache_jax.models.presets import preset_config
from hicache_jax.models.registry import config_from_hf
from hicache_jax.tpu.configs import HF_CONFIGS, real_config

BF16 = 2
KIB = 1024

# DeepSeek V4 Flash's published config.json (``tpu/configs.py``).
V4_FLASH = HF_CONFIGS["deepseek-v4-flash"]
# V4 Pro's attention layout on Flash's attention widths (KV only: its hidden size, heads and
# experts differ and are not needed here).
V4_PRO_KV = V4_FLASH | {
    "num_hidden_layers": 61,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    "num_nextn_predict_layers": 0,
}
# DeepSeek V3.2: V3's layers with DSA (an indexer of 64 heads of 128, top 2,048).
V32 = HF_CONFIGS["deepseek-v3"] | {
    "architectures": ["DeepseekV32ForCausalLM"],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}


def row(name: str, cfg) -> tuple:
    pages = page_bytes(cfg, BF16, 1)
    this = sum(pages.values())
    latent = pages.get(L3_SUFFIX[CacheKind.LATENT], 0)
    index = pages.get(L3_SUFFIX[CacheKind.INDEX], 0)
    m, n = cfg.mla, cfg.num_layers
    gqa = n * 2 * 8 * 128 * BF16
    mha = n * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * BF16
    return name, n, latent, index, this, gqa, mha


def pool_bytes(cfg, page_size: int) -> dict[CacheKind, int]:
    """Bytes of one page of each cache kind, every layer (bfloat16; the state in float32)."""
    out: dict[CacheKind, int] = collections.Counter()
    for specs in layer_specs(cfg):
        for s in specs:
            out[s.kind] += s.page_values(page_size) * s.value_bytes(BF16)
    return dict(out)


def sequence_bytes(cfg, page_size: int, context: int) -> dict[CacheKind, int]:
    """Bytes a sequence of ``context`` tokens holds in each pool: every page of an
    every-page kind, the pages its window covers of a window kind."""
    pools = pool_bytes(cfg, page_size)
    rules = PrefixRules(page_size, tuple(pools), cfg.sliding_window)
    return {kind: len(rules.pages_needed(kind, context)) * b for kind, b in pools.items()}


def per_token(cfg, page_size: int, context: int) -> float:
    """Bytes per token of a sequence of ``context`` tokens (a whole number of pages)."""
    return sum(sequence_bytes(cfg, page_size, context).values()) / context


def stored_per_token(cfg, page_size: int) -> float:
    """Bytes per token L2 and L3 keep: every page of every kind."""
    return sum(pool_bytes(cfg, page_size).values()) / page_size


def tokens(n: int) -> str:
    return f"{n // KIB}K" if n < KIB * KIB else f"{n // (KIB * KIB)}M"


def v4_tables(page_size: int, contexts: tuple[int, ...]) -> None:
    flash, pro = config_from_hf(V4_FLASH, "V4 Flash"), config_from_hf(V4_PRO_KV, "V4 Pro (KV)")
    v32 = config_from_hf(V32, "V3.2")
    models = [
        ("DeepSeek V4 Flash", flash),
        ("DeepSeek V4 Pro layout", pro),
        ("DeepSeek V3.2", v32),
        ("GLM-5", real_config("glm-5")),
        ("Llama-3-8B", real_config("llama-3-8b")),
    ]
    print(f"\nDeepSeek V4 pool by pool (bfloat16 rows, float32 state; pages of {page_size} tokens):\n")
    print("| model | pool | retention | bytes per page, every layer | per token |")
    print("|---|---|---|---|---|")
    for name, cfg in models[:2]:
        kinds = dict(sorted(collections.Counter(cfg.layer_kinds).items(), key=lambda kv: kv[0]))
        label = f"{name} ({', '.join(f'{n} {kind}' for kind, n in kinds.items())})"
        pools = pool_bytes(cfg, page_size)
        for kind in sorted(pools, key=list(CacheKind).index):
            b = pools[kind]
            print(f"| {label} | {kind} | {retention(kind).value} | {b:,} | {b / page_size:,.0f} B |")
            label = ""
    head = " | ".join(f"a sequence at {tokens(c)}" for c in contexts)
    ratios = " | ".join(f"V3.2 / this at {tokens(c)}" for c in contexts)
    print(f"\nKV bytes per token (pages of {page_size} tokens):\n")
    print(
        f"| model | layers | every page, per token | window pools, per sequence | {head} | {ratios} "
        "| L2/L3 per token (every page's window too) |"
    )
    print("|---|---|---|---|" + "---|" * 2 * len(contexts) + "---|")
    ref = {c: per_token(v32, page_size, c) for c in contexts}
    for name, cfg in models:
        every = sum(b for kind, b in pool_bytes(cfg, page_size).items() if retention(kind) is Retention.EVERY)
        seq = sequence_bytes(cfg, page_size, contexts[0])
        window = sum(b for kind, b in seq.items() if retention(kind) is Retention.WINDOW)
        window_s = f"{window / KIB / KIB:.1f} MiB" if window else "-"
        at = [per_token(cfg, page_size, c) for c in contexts]
        cells = " | ".join(f"{t / KIB:.2f} KiB" for t in at)
        rs = " | ".join(f"{ref[c] / t:.1f}x" for c, t in zip(contexts, at))
        stored = stored_per_token(cfg, page_size)
        print(
            f"| {name} | {cfg.num_layers} | {every / page_size / KIB:.2f} KiB | {window_s} | {cells} "
            f"| {rs} | {stored / KIB:.1f} KiB |"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page_size", type=int, default=256, help="DeepSeek V4's pages (a multiple of 128)")
    p.add_argument("--contexts", default="131072,1048576", help="sequence lengths for the V4 table")
    args = p.parse_args()
    rows = [row(n, real_config(n)) for n in ("deepseek-v3", "kimi-k2", "glm-5")]
    rows.append(row("100m-mla (preset)", preset_config("100m-mla")))
    head = ("model", "layers", "latent B/token", "indexer B/token", "this", "GQA-8", "this / GQA-8", "MHA")
    print("| " + " | ".join(head) + " | this / MHA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, latent, index, this, gqa, mha in rows:
        print(
            f"| {name} | {n} | {latent:,} | {index:,} | {this / 1024:.1f} KiB | {gqa / 1024:.1f} KiB "
            f"| {this / gqa:.3f} | {mha / 1024:.0f} KiB | {this / mha:.4f} |"
        )
    v4_tables(args.page_size, tuple(int(c) for c in args.contexts.split(",")))


if __name__ == "__main__":
    main()
