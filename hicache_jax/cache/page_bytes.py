"""Bytes of one L2/L3 page of each kind a model stores, and the L3 bandwidth at a token rate.

Pages are stored whole (the same at every tp_size): per token, full-attention layers store K
and V of every KV head; sliding-window layers the same, but a prefix hit reads only the
window behind its end; a Mamba layer stores at most one state snapshot per page.
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def page_bytes(cfg, dtype_bytes: int, page_size: int) -> dict[str, int]:
    """Bytes of one page of each kind the model stores (``storage_tier.SUFFIX`` kinds)."""
    kinds = cfg.layer_kinds
    kv = 2 * page_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    out = {}
    if "attention" in kinds:
        out["kv"] = kinds.count("attention") * kv
    if "sliding" in kinds:
        out["swa"] = kinds.count("sliding") * kv
    if "mamba" in kinds:
        m = cfg.mamba
        conv = (m.conv_kernel - 1) * m.conv_dim * dtype_bytes
        ssm = m.num_heads * m.head_dim * m.state_size * 4  # float32
        out["mamba"] = kinds.count("mamba") * (conv + ssm)
    return out


def read_bytes_per_token(cfg, dtype_bytes: int, page_size: int) -> float:
    """Upper bound of the L3 bytes read per prompt token a hit serves (KV pages; sliding
    layers read only their window, Mamba layers one snapshot per hit, both less)."""
    pages = page_bytes(cfg, dtype_bytes, page_size)
    return (pages.get("kv", 0) + pages.get("swa", 0)) / page_size
