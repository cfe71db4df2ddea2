"""KV bytes one token leaves in the cache (every layer, bfloat16), for the latent-attention
families against the attention layouts of the same model size.

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
"""

from __future__ import annotations

from hicache_jax.kinds import L3_SUFFIX, CacheKind
from hicache_jax.models.page_bytes import page_bytes
from hicache_jax.models.presets import preset_config
from hicache_jax.tpu.configs import real_config

BF16 = 2


def row(name: str, cfg) -> tuple:
    pages = page_bytes(cfg, BF16, 1)
    this = sum(pages.values())
    latent = pages.get(L3_SUFFIX[CacheKind.LATENT], 0)
    index = pages.get(L3_SUFFIX[CacheKind.INDEX], 0)
    m, n = cfg.mla, cfg.num_layers
    gqa = n * 2 * 8 * 128 * BF16
    mha = n * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * BF16
    return name, n, latent, index, this, gqa, mha


def main() -> None:
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


if __name__ == "__main__":
    main()
