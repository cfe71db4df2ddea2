"""How much L3 bandwidth a server needs: bytes per token of each page kind, times tokens/s.

    python benchmarks/l3_calculator.py [--preset 100m | --model_path DIR] [--dtype bfloat16]
                                       [--page_size 64] [--tokens_per_s 20000] [--hit_rate 0.5]

Pages are stored whole (the same at every tp_size), so the numbers do not depend on it:
per token, full-attention layers store K and V of every KV head; sliding-window layers the
same, but a prefix hit reads only the window behind its end; a Mamba layer stores at most
one state snapshot per page (one per radix node that holds one). Writes: every prompt
token that reaches L2 (write_through) is written once. Reads: the share of prompt tokens
served from L3 (``--hit_rate``).
"""

from __future__ import annotations

import argparse

from hicache_jax.models.page_bytes import DTYPE_BYTES, page_bytes, read_bytes_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--model_path", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--page_size", type=int, default=64)
    ap.add_argument("--tokens_per_s", type=float, default=20000.0, help="prompt tokens/s served")
    ap.add_argument("--hit_rate", type=float, default=0.5, help="share of prompt tokens read from L3")
    a = ap.parse_args()
    if a.model_path:
        from hicache_jax.models.loader import read_hf_config
        from hicache_jax.models.registry import config_from_hf

        cfg = config_from_hf(read_hf_config(a.model_path), a.model_path)
    else:
        from hicache_jax.models.presets import preset_config

        cfg = preset_config(a.preset)
    pages = page_bytes(cfg, DTYPE_BYTES[a.dtype], a.page_size)
    write_per_token = sum(pages.values()) / a.page_size
    read_per_token = read_bytes_per_token(cfg, DTYPE_BYTES[a.dtype], a.page_size)  # upper bound
    write = write_per_token * a.tokens_per_s
    read = read_per_token * a.tokens_per_s * a.hit_rate
    print(f"{cfg.architecture}: {a.dtype}, page of {a.page_size} tokens")
    for kind, b in pages.items():
        print(f"  {kind:>5} page {b / 2**20:8.3f} MiB   {b / a.page_size / 1024:8.1f} KiB/token")
    rate = f"{a.tokens_per_s:.0f} tokens/s"
    print(f"writes (at most): {write_per_token / 1024:.1f} KiB/token x {rate} = {write / 1e9:.2f} GB/s")
    print(
        f"reads (at most; sliding layers read only their window): {read_per_token / 1024:.1f} KiB/token"
        f" x {rate} x hit rate {a.hit_rate} = {read / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
