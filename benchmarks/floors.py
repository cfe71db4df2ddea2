"""The compute yardstick: a step's FLOPs and the matmul rate measured in the same run.

``step_flops(cfg, seqs, logits_rows)`` counts the multiply-adds a step cannot avoid (2 FLOPs
each): every projection and MLP matmul for each new token (for a mixture-of-experts layer,
its router and the ``top_k`` experts each token uses), attention scores and values over
the keys each query may see (its causal prefix, or the window for sliding layers; for
DeepSeek V4 the window plus the compressed entries it attends, and CSA's indexer), the Mamba
and Gated DeltaNet projections and state updates, and the LM head for the rows whose logits the step returns.
Norms, RoPE, softmax and the sampler are not counted: they are elementwise, and the memory
floor accounts for them. ``matmul_rate()`` is the best FLOPs/s of a few large float32
matmuls on this device, so ``flops / rate`` is the time a perfect kernel would take.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from hicache_jax.models.config import ModelConfig


def matmul_rate(repeats: int = 5) -> float:
    """FLOPs per second of the fastest of a few large float32 matmuls (best of ``repeats``)."""
    best = 0.0
    for m, k, n in ((1024, 1024, 1024), (2048, 768, 2048), (256, 2048, 2048)):
        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        f = jax.jit(jnp.matmul)
        f(a, b).block_until_ready()
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
    return best


def _span(kind: str, cfg: ModelConfig, pos: int) -> int:
    """Keys the query at ``pos`` attends to."""
    return min(pos + 1, cfg.sliding_window) if kind == "sliding" else pos + 1


def _latent_attention_flops(cfg: ModelConfig, kind: str, seqs: list[tuple[int, int]]) -> float:
    """MLA in the absorbed form: the query, latent and output projections per token, the
    query's no-rope part into latent space and the output out of it (``W_UK``, ``W_UV``), and
    scores (latent + rope) and values (latent) over the positions each query attends: all it
    sees, or at most ``index_topk`` in a sparse layer (whose indexer is counted too)."""
    m, h, H = cfg.mla, cfg.hidden_size, cfg.num_heads
    L, R = m.kv_lora_rank, m.qk_rope_head_dim
    q_proj = h * H * m.qk_head_dim if not m.q_lora_rank else (h + H * m.qk_head_dim) * m.q_lora_rank
    per_token = 2 * (q_proj + h * (L + R) + H * m.v_head_dim * h)
    per_token += 2 * H * L * (m.qk_nope_head_dim + m.v_head_dim)
    sparse = kind != "mla" and m.index_topk
    flops = 0.0
    for q, kv in seqs:
        positions = range(kv - q, kv)
        keys = sum(min(p + 1, m.index_topk) if sparse else p + 1 for p in positions)
        flops += q * per_token + 2 * H * (2 * L + R) * keys
        if kind == "dsa":  # its projections, then every visible key scored by every indexer head
            d, nh = m.index_head_dim, m.index_n_heads
            flops += q * 2 * (m.q_lora_rank * nh * d + h * d + h * nh)
            flops += 2 * nh * d * sum(p + 1 for p in positions)
    return flops


def _dsv4_flops(cfg: ModelConfig, kind: str, seqs: list[tuple[int, int]]) -> float:
    """A DeepSeek V4 layer: its query (through ``q_lora_rank``), K=V and grouped output
    projections and its two hyper-connections per token; a compressed layer's compressor
    projections (and a CSA layer's indexer: its keys' compressor, queries and head weights);
    scores and values over the rows each query attends: the window's, plus every visible
    entry (HCA) or at most ``index_topk`` of them (CSA), whose indexer scores every visible
    entry with every head."""
    v, h, H, D = cfg.dsv4, cfg.hidden_size, cfg.num_heads, cfg.head_dim
    n = v.hc_mult
    proj = h * v.q_lora_rank + v.q_lora_rank * H * D + h * D + H * D * v.o_lora_rank
    proj += v.o_groups * v.o_lora_rank * h
    hyper = 2 * ((2 + n) * n * n * h + n * n * h + 2 * n * h)  # mixes, then collapse, comb, post
    rate = v.rate(kind) if kind != "swa_mqa" else 0
    if rate:
        proj += 2 * h * (2 if kind == "csa" else 1) * D  # kv and gate, two series for CSA
    if kind == "csa":
        d, nh = v.index_head_dim, v.index_n_heads
        proj += 2 * h * 2 * d + v.q_lora_rank * nh * d + h * nh
    flops = 0.0
    for q, kv in seqs:
        keys = scored = 0
        for p in range(kv - q, kv):
            visible = (p + 1) // rate if rate else 0
            keys += min(p + 1, cfg.sliding_window) + (
                min(visible, v.index_topk) if kind == "csa" else visible
            )
            scored += visible if kind == "csa" else 0
        flops += q * 2 * (proj + hyper) + 2 * 2 * H * D * keys
        flops += 2 * v.index_n_heads * (v.index_head_dim + 1) * scored  # scores, head weights
    return flops


def step_flops(cfg: ModelConfig, seqs: list[tuple[int, int]], logits_rows: int | None = None) -> float:
    """FLOPs of one step over ``seqs`` = (new tokens, tokens in the cache after the step)."""
    h = cfg.hidden_size
    tokens = sum(q for q, _ in seqs)
    qkvo = 2 * h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    flops = 0.0
    for i, kind in enumerate(cfg.layer_kinds):
        # Dense: gate, up and down. MoE: the router, and each token's top_k experts only
        # (a hash layer looks its experts up: its table is no matmul).
        flops += tokens * 2 * cfg.mlp_params(i, active=True)
        if cfg.dsv4 is not None and i in cfg.dsv4.hash_layers:
            flops -= tokens * 2 * cfg.vocab_size * cfg.moe.top_k
        if kind == "mamba":
            m = cfg.mamba
            inner = m.intermediate_size
            proj = 2 * h * (inner + m.conv_dim + m.num_heads) + 2 * inner * h
            conv = 2 * m.conv_kernel * m.conv_dim
            ssd = 2 * 3 * m.num_heads * m.head_dim * m.state_size  # decay, update, read-out
            flops += tokens * (proj + conv + ssd)
            continue
        if kind == "gdn":
            g = cfg.gdn
            proj = 2 * h * (g.conv_dim + g.value_dim + 2 * g.num_v_heads) + 2 * g.value_dim * h
            conv = 2 * g.conv_kernel * g.conv_dim
            rule = 2 * 3 * g.num_v_heads * g.head_k_dim * g.head_v_dim  # k.S, the rank-1 update, q.S
            flops += tokens * (proj + conv + rule)
            continue
        if kind in ("mla", "dsa", "dsa_shared"):
            flops += _latent_attention_flops(cfg, kind, seqs)
            continue
        if kind in ("swa_mqa", "csa", "hca"):
            flops += _dsv4_flops(cfg, kind, seqs)
            continue
        flops += tokens * qkvo
        for q, kv in seqs:
            keys = sum(_span(kind, cfg, p) for p in range(kv - q, kv))
            flops += 2 * 2 * cfg.num_heads * cfg.head_dim * keys  # scores, then values
    rows = len(seqs) if logits_rows is None else logits_rows
    return flops + rows * 2 * h * cfg.vocab_size
