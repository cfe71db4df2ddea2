"""L2 hits under memory pressure, for every recurrent family: requests branch off a shared
prefix in the middle of a chunk and of a page, the device pool is too small for them, the
prefix they share is evicted from L1 between two waves and comes back from host memory
(L2), and every request still ends with the output it gets alone (one at a time, without a
prefix cache, on a pool of the same shape). (A host-tier hit that
returned wrong output for a GDN/Mamba hybrid is a reported bug elsewhere.)"""

import numpy as np
import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine

PAGE, CHUNK = 16, 64
SHARED = 112  # the shared prefix: past a chunk boundary, ending mid-page
BRANCHES = (40, 72, 90, 104)  # mid-chunk, none on a page boundary


def run(engine, prompts, params, check_every_step=True):
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        if check_every_step:
            engine.check_integrity()
    return [engine.pop_output(r)["output_ids"] for r in rids]


def _params(n, offset):
    return [
        {
            "max_new_tokens": 6,
            "ignore_eos": True,
            "temperature": 0.0 if i % 2 else 0.8,
            "top_k": 50,
            "seed": offset + i,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "preset,kv_dtype",
    [
        ("tiny-mamba", "auto"),
        ("tiny-nemotron-h", "auto"),
        ("tiny-granite-h", "auto"),
        ("tiny-qwen3.5", "auto"),
        ("tiny-qwen3-next", "auto"),
        ("tiny-mla", "auto"),
        ("tiny-dsa", "auto"),
        # Branches inside compression windows (CSA 4 tokens, HCA 16): the compressors' state
        # pages come back from L2 with the window and compressed pages.
        ("tiny-dsv4", "auto"),
        # 8-bit pages (issue 46) leave L1 and come back from L2 as they were: the solo run
        # with the same dtype is the reference.
        ("tiny-qwen3.5", "float8_e4m3fn"),
        ("tiny-mla", "int8"),
    ],
)
def test_l2_hits_under_pressure_give_solo_outputs(preset, kv_dtype):
    rng = np.random.RandomState(1)
    shared = rng.randint(3, 500, SHARED).tolist()

    def branch(b):
        return shared[:b] + rng.randint(3, 500, rng.randint(8, 24)).tolist()

    first = [branch(b) for b in BRANCHES]
    filler = [rng.randint(3, 500, 80).tolist() for _ in range(2)]  # unrelated: pushes the prefix out of L1
    second = [branch(b) for b in BRANCHES[::-1]] + [shared + [7, 8, 9]]
    waves = [(first, _params(len(first), 0)), (filler, _params(2, 100)), (second, _params(len(second), 200))]
    base = dict(
        preset=preset,
        kv_cache_dtype=kv_dtype,
        page_size=PAGE,
        chunked_prefill_size=CHUNK,
        max_running_requests=4,
        max_total_tokens=14 * PAGE,  # each request fits alone; a wave does not
        mamba_cache_slots=8,  # snapshots leave L1 too: the hit loads its state from L2
    )
    solo = Engine(EngineConfig(**base, disable_radix_cache=True))
    alone = [[run(solo, [p], [sp], check_every_step=False)[0] for p, sp in zip(*wave)] for wave in waves]

    engine = Engine(EngineConfig(**base, enable_hierarchical_cache=True, hicache_ratio=8.0))
    got = [run(engine, *wave) for wave in waves[:2]]
    before = engine.prefix_cache.counters["host_loads"]
    got.append(run(engine, *waves[2]))
    loads = engine.prefix_cache.counters["host_loads"] - before
    assert loads > 0, "the second wave was meant to hit L2 (the filler evicted the prefix from L1)"
    for w, (g, a) in enumerate(zip(got, alone)):
        for i, (x, y) in enumerate(zip(g, a)):
            assert x == y, f"wave {w} request {i} differs from its solo run (L2 loads: {loads})"
    assert engine.flush_cache().success
    engine.check_integrity()
    for pool in engine.prefix_cache.pools.values():
        assert pool.num_used == 0, f"{pool.name}: {pool.num_used} still in use after flush"
