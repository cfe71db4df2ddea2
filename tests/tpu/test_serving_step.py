"""The serving step and the L2 page copies of every family, compiled for TPU slices with the
Pallas backends: built from shapes by the engine's own code (``hicache_jax/tpu/abstract.py``),
at real widths, cut to one layer of each kind the model has to bound compile time.

Programs: the largest decode bucket and the largest prefill bucket (mixed batches run the
prefill program), and the smallest and largest page copy of each kind; one family also
compiles per-token logits rows with top logprobs. A step program's TPU compile time grows
with its token and sequence widths, not with the code compiled (mostly the matmuls' codegen
and the sampler's candidates: Mistral-7B's decode and prefill on v5e:2x2 take 6.8 and 11.9 s
at the engine's default chunk of 512 and 32 running requests, 3.3 and 7.1 s at 256 and 8),
so these compile at 256 and 8. The kernel matrices (``test_*_kernels.py``) cover the
kernels at the wider shapes the default buckets produce, and the planner
(``python -m hicache_jax.plan``) compiles the real flags at full depth.
"""

from __future__ import annotations

import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.tpu.abstract import AbstractServer
from hicache_jax.tpu.configs import real_config
from hicache_jax.tpu.hbm import in_vmem
from hicache_jax.tpu.target import target

FAMILIES = ("mistral-7b", "llama-3-8b", "gemma-3-4b", "bamba-9b")
SLICES = (("v5e:2x2", 4), ("v6e:2x4", 8))
SERVING = dict(
    dtype="bfloat16",
    page_size=16,
    chunked_prefill_size=256,  # the engine's defaults are 512 and 32 (see the module docstring)
    max_running_requests=8,
    max_total_tokens=65536,
    enable_hierarchical_cache=True,
)


def chosen(server: AbstractServer, logprob_rows: bool = False) -> set[str]:
    """Names of the programs compiled here (``logprob_rows``: only the every-row logprob
    program; the others are compiled by ``test_serving_programs_compile``)."""
    b = server.builder
    S, T = b.max_running, b.buckets[-1]
    if logprob_rows:
        return {f"prefill step T={T} S={S} R={T} top=20"}
    return _step_and_copies(server)


def _step_and_copies(server: AbstractServer) -> set[str]:
    """The largest decode and prefill steps, and the smallest and largest page copies."""
    b = server.builder
    S, T = b.max_running, b.buckets[-1]
    decode = max(s for _, s, _, decode_only in b.warmup_shapes() if decode_only)
    names = {f"decode step T={decode} S={decode} R={decode} top=0", f"prefill step T={T} S={S} R={S} top=0"}
    for kind in server.transfer.kinds():
        for n in (server.transfer.buckets(kind)[0], server.transfer.buckets(kind)[-1]):
            names |= {f"read {kind} x{n}", f"write {kind} x{n}"}
    return names


def compile_chosen(family: str, topology: str, tp: int, logprob_rows: bool = False):
    cfg = EngineConfig(tp_size=tp, **SERVING)
    server = AbstractServer.build(real_config(family, num_layers=1), cfg, target(topology))
    want = chosen(server, logprob_rows)
    compiled = dict(server.compile(lambda name: name in want))
    assert set(compiled) == want
    return server, compiled


@pytest.mark.parametrize("topology,tp", SLICES, ids=[s for s, _ in SLICES])
@pytest.mark.parametrize("family", FAMILIES)
def test_serving_programs_compile(family, topology, tp):
    server, compiled = compile_chosen(family, topology, tp)  # raises naming the program that fails
    # The step's kernels read a few pages of each pool by DMA: no pool is moved into VMEM
    # around them (whole, it would be copied in and back every step).
    for name, program in compiled.items():
        moved = in_vmem(program, server.kernel_pool_shapes()) if "step" in name else []
        assert not moved, (name, moved[:4])


def test_logprob_rows_compile():
    """The largest program serving runs: every prefill token's logits, with top logprobs."""
    compile_chosen("gemma-3-4b", "v5e:2x2", 4, logprob_rows=True)
