"""The serving step and the L2 page copies of every family, compiled for TPU slices with the
Pallas backends: built from shapes by the engine's own code (``hicache_jax/tpu/abstract.py``),
at real widths, cut to one layer of each kind the model has to bound compile time (DeepSeek
V4 Flash's window, CSA and HCA layers, the last routed by its gate as its 4th is: its first
three route by token id), at page size 16 (128 where pages must hold whole compressed
entries).

Each family compiles a step program on both slices (v5e:2x2 at tp 4, v6e:2x4 at tp 8): its
largest decode bucket on one and its largest prefill bucket (mixed batches run it) on the
other, swapped from family to family (``STEPS``), so each slice compiles about as many
families' decode steps as prefill steps, and each family both kinds. The two kinds are
one function at two widths (and the kernel matrices, ``test_*_kernels.py``, compile every
kernel for every chip in both kinds), while a step program costs 4-25 s of TPU compile: all
of them on both slices was most of this group's time. Gemma 3's prefill program is the one
with every token's logits row and top logprobs, the largest program serving runs. The
smallest and largest page copy of each kind compile on both slices. ``HICACHE_TPU_FULL=1``
compiles both kinds on both slices, and the logprob-row program besides the plain one.

Where a step program's TPU compile time goes: the sampler, penalties included, is about
half of it and grows with the vocabulary per chip (Gemma-3-4B's decode on v5e:2x2: 13 s,
4.8 s with a bare argmax in its place); the forward grows with the token width (Mistral-7B's
decode and prefill on v5e:2x2 take 6.8 and 11.9 s at the engine's default chunk of 512 and
32 running requests, 4.1 and 7.2 s at 128 and 8; Bamba-9B's prefill on v6e:2x4, 25 s at
256 and 19 s at 128). So these compile at 128 and 8. The kernel matrices cover the kernels
at the wider shapes the default buckets produce, and the planner (``python -m
hicache_jax.plan``) compiles the real flags at full depth.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.tpu.abstract import AbstractServer
from hicache_jax.tpu.configs import real_config
from hicache_jax.tpu.hbm import in_vmem
from hicache_jax.tpu.target import target

V5E, V6E = "v5e:2x2", "v6e:2x4"
TP = {V5E: 4, V6E: 8}
# The step program each family compiles on each slice ("rows": prefill with every token's
# logits row and top logprobs).
STEPS = {
    "mistral-7b": {V5E: "decode", V6E: "prefill"},
    "llama-3-8b": {V5E: "prefill", V6E: "decode"},
    "gemma-3-4b": {V5E: "rows", V6E: "decode"},
    "bamba-9b": {V5E: "decode", V6E: "prefill"},
    "qwen3-30b-a3b": {V5E: "prefill", V6E: "decode"},  # 128 experts: 32, then 16 per chip
    "gpt-oss-20b": {V5E: "decode", V6E: "prefill"},  # sinks, biases, YaRN, 32 experts
    "olmo-3-7b": {V5E: "prefill", V6E: "decode"},  # q/k norms over the projections, YaRN
    "nemotron-h-8b": {V5E: "decode", V6E: "prefill"},  # no RoPE, squared-ReLU MLPs
    "granite-4.0-h-small": {V5E: "prefill", V6E: "decode"},  # 72 experts and a shared MLP; multipliers
    "qwen3-next-80b-a3b": {V5E: "decode", V6E: "prefill"},  # GDN, gated attention, 512 experts
    "qwen3.5-27b": {V5E: "prefill", V6E: "decode"},  # GDN split by key-head group (16 over 4, 8)
    "kimi-k2": {V5E: "decode", V6E: "prefill"},  # MLA (64 heads over 8: 8 per chip), 384 experts
    "glm-5": {V5E: "prefill", V6E: "decode"},  # MLA with DSA's indexer (top 2,048), 256 experts
    # One K=V head of 512 (64 query heads over 8: 8 per chip), a window of 128, CSA's indexer
    # (top 512) and HCA's every entry, 4 mHC streams, 256 experts (hash-routed, then top 6).
    "deepseek-v4-flash": {V5E: "decode", V6E: "prefill"},
}
# Gated DeltaNet families compile the xla GDN kernel beside Pallas attention until the GDN
# Pallas kernels land (their own branch); the xla chunked scan makes the prefill programs
# the slowest here (60-80 s).
GDN_PALLAS = importlib.util.find_spec("hicache_jax.models.kernels.gated_delta_rule.kernel") is not None
GDN_FAMILIES = ("qwen3-next-80b-a3b", "qwen3.5-27b")
FULL = os.environ.get("HICACHE_TPU_FULL") == "1"
SERVING = dict(
    dtype="bfloat16",
    page_size=16,
    chunked_prefill_size=128,  # the engine's defaults are 512 and 32 (see the module docstring)
    max_running_requests=8,
    max_total_tokens=65536,
    enable_hierarchical_cache=True,
)


def step_names(server: AbstractServer, kinds: set[str]) -> set[str]:
    """Names of the step programs of ``kinds``: "decode" (the largest decode bucket),
    "prefill" (the largest prefill bucket) and "rows" (that bucket with every token's logits
    row and top logprobs)."""
    b = server.builder
    S, T = b.max_running, b.buckets[-1]
    decode = max(shape.S for shape in b.warmup_shapes() if shape.decode_only)
    names = {
        "decode": f"decode step T={decode} S={decode} R={decode} top=0",
        "prefill": f"prefill step T={T} S={S} R={S} top=0",
        "rows": f"prefill step T={T} S={S} R={T} top=20",
    }
    return {names[k] for k in kinds}


def copy_names(server: AbstractServer) -> set[str]:
    """The smallest and largest page copies (both directions) of each page kind."""
    names = set()
    for kind in server.transfer.kinds():
        for n in (server.transfer.buckets(kind)[0], server.transfer.buckets(kind)[-1]):
            names |= {f"read {kind} x{n}", f"write {kind} x{n}"}
    return names


def compile_chosen(family: str, topology: str):
    gdn = {} if GDN_PALLAS or family not in GDN_FAMILIES else {"ssd_backend": "xla"}
    model_cfg = real_config(family, num_layers=1)
    if model_cfg.dsv4 is not None:  # its 3 layers are all hash-routed ones: the last by its gate
        dsv4 = dataclasses.replace(model_cfg.dsv4, hash_layers=model_cfg.dsv4.hash_layers[:-1])
        model_cfg = dataclasses.replace(model_cfg, dsv4=dsv4)
    # Pages hold whole compressed entries (DeepSeek V4: a multiple of 128).
    page_size = math.lcm(SERVING["page_size"], model_cfg.page_multiple)
    cfg = EngineConfig(tp_size=TP[topology], **(SERVING | {"page_size": page_size}), **gdn)
    server = AbstractServer.build(model_cfg, cfg, target(topology))
    kinds = {"decode", "prefill", "rows"} if FULL else {STEPS[family][topology]}
    want = step_names(server, kinds) | copy_names(server)
    compiled = dict(server.compile(lambda name: name in want))
    assert set(compiled) == want
    return server, compiled


def test_every_family_compiles_both_kinds_and_each_slice_both():
    for slices in STEPS.values():
        assert {k.replace("rows", "prefill") for k in slices.values()} == {"decode", "prefill"}
    for topology in TP:
        kinds = [slices[topology].replace("rows", "prefill") for slices in STEPS.values()]
        assert abs(kinds.count("decode") - kinds.count("prefill")) <= 1, (topology, kinds)


@pytest.mark.parametrize("topology", list(TP))
@pytest.mark.parametrize("family", list(STEPS))
def test_serving_programs_compile(family, topology):
    server, compiled = compile_chosen(family, topology)  # raises naming the program that fails
    # The step's kernels read a few pages of each pool by DMA: no pool is moved into VMEM
    # around them (whole, it would be copied in and back every step).
    for name, program in compiled.items():
        moved = in_vmem(program, server.kernel_pool_shapes()) if "step" in name else []
        if family in POOL_COPIED and "step" in name:
            assert moved, f"{family}: the pool is no longer copied; drop it from POOL_COPIED"
            continue
        assert not moved, (name, moved[:4])


# A known defect, asserted so that its fix shows: pages of [page_size, Hkv, 64] (2 or 1 KV
# heads of 64 per chip) pad 8-16x in the TPU's (8, 128) tiles, so XLA lays the pool out
# page-index-minor and copies it whole into the kernel's row layout every step. Storing
# pools as [pages, page_size, Hkv * D] (rows of 128 lanes, heads side by side) would fix it.
#
# DeepSeek V4's attention is XLA's own gathers (no kernel reads its pools by DMA), and XLA
# stages pools that fit in VMEM there whole, every step: at this 65,536-token budget the
# compressed ones on v5e (CSA entries 16 MiB, indexer keys 4 MiB, HCA entries and state) and
# the window rows too (64 MiB) in v6e's prefill. Pools of a serving budget outgrow VMEM; a
# kernel reading the window and the picked entries by DMA would fix it at any size.
POOL_COPIED = {"gpt-oss-20b", "deepseek-v4-flash"}
