"""Under memory pressure (a few pages, 12 concurrent requests) requests are retracted and
resumed, yet each ends with the output it gets alone; nothing leaks."""

import numpy as np
import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine


def run(engine, prompts, params, check_every_step=False):
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        if check_every_step:
            engine.check_integrity()
    return [engine.pop_output(r) for r in rids]


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa", "tiny-mamba"])  # MoE: test_liveness.py
def test_pressure_gives_the_outputs_of_solo_runs(preset):
    rng = np.random.RandomState(0)
    shared = rng.randint(3, 500, 24).tolist()
    prompts = [
        shared[: rng.randint(0, 24)] + rng.randint(3, 500, rng.randint(5, 30)).tolist() for _ in range(12)
    ]
    params = [
        {
            "max_new_tokens": 14,
            "ignore_eos": True,
            "temperature": 0.0 if i % 2 else 0.8,
            "top_k": 50,
            "seed": i,
        }
        for i in range(12)
    ]
    base = dict(
        preset=preset,
        page_size=16,
        chunked_prefill_size=64,
        max_running_requests=16,
        max_total_tokens=12 * 16,
    )
    # Alone: one at a time without a prefix cache, on a pool of the same shape (each request
    # fits 12 pages alone), so both engines share their compiled steps.
    solo = Engine(EngineConfig(**base, disable_radix_cache=True))
    alone = [run(solo, [p], [sp])[0]["output_ids"] for p, sp in zip(prompts, params)]

    tight = Engine(EngineConfig(**base))  # 12 pages for ~12 x 3 needed
    outs = run(tight, prompts, params, check_every_step=True)
    assert tight.scheduler.num_retractions > 0, "the pool was meant to be too small"
    for i, (o, a) in enumerate(zip(outs, alone)):
        assert o["output_ids"] == a, f"request {i} changed under pressure"
    assert tight.flush_cache().success
    tight.check_integrity()
    for pool in tight.prefix_cache.pools.values():
        assert pool.num_used == 0, f"{pool.name}: {pool.num_used} still in use after flush"
