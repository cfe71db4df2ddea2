"""The serving step and the L2 page copies of every family, compiled for TPU slices with the
Pallas backends: built from shapes by the engine's own code (``hicache_jax/tpu/abstract.py``),
at real widths, cut to two layers (one of each kind the model has) to bound compile time.

Programs: the smallest and largest decode bucket, the smallest and largest prefill bucket
(mixed batches run the prefill program), per-token logits rows with top logprobs, and the
smallest and largest page copy of each kind. The kernel matrices (``test_*_kernels.py``)
cover every other shape the buckets produce.
"""

from __future__ import annotations

import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.tpu.abstract import AbstractServer
from hicache_jax.tpu.configs import real_config
from hicache_jax.tpu.target import target

FAMILIES = ("mistral-7b", "llama-3-8b", "gemma-3-4b", "bamba-9b")
SLICES = (("v5e:2x2", 4), ("v6e:2x4", 8))
SERVING = dict(
    dtype="bfloat16",
    page_size=16,
    chunked_prefill_size=512,
    max_running_requests=32,
    max_total_tokens=65536,
    enable_hierarchical_cache=True,
)


def chosen(server: AbstractServer):
    """Names of the programs compiled here: the extremes of each bucket list."""
    b = server.builder
    S = b.max_running
    decode = sorted(s for _, s, _, decode_only in b.warmup_shapes() if decode_only)
    names = {f"decode step T={d} S={d} R={d} top=0" for d in (decode[0], decode[-1])}
    names |= {f"prefill step T={t} S={S} R={S} top=0" for t in (b.buckets[0], b.buckets[-1])}
    names.add(f"prefill step T={b.buckets[0]} S={S} R={b.buckets[0]} top=20")
    for kind in server.transfer.kinds():
        for n in (server.transfer.buckets(kind)[0], server.transfer.buckets(kind)[-1]):
            names |= {f"read {kind} x{n}", f"write {kind} x{n}"}
    return names


@pytest.mark.parametrize("topology,tp", SLICES, ids=[s for s, _ in SLICES])
@pytest.mark.parametrize("family", FAMILIES)
def test_serving_programs_compile(family, topology, tp):
    cfg = EngineConfig(tp_size=tp, **SERVING)
    server = AbstractServer.build(real_config(family, num_layers=2), cfg, target(topology))
    want = chosen(server)
    compiled = dict(server.compile(lambda name: name in want))
    assert set(compiled) == want
    pool = server.cache_bytes()
    for name, c in compiled.items():
        mem = c.memory_analysis()
        assert mem.temp_size_in_bytes <= 0.25 * pool, (
            f"{name}: {mem.temp_size_in_bytes / 2**20:.0f} MiB of temporaries for a "
            f"{pool / 2**20:.0f} MiB pool"
        )
