"""After warm-up, a varied stream of requests compiles nothing new."""

import numpy as np

from hicache_jax.config import EngineConfig
from hicache_jax.engine import Engine


def test_varied_stream_after_warmup_compiles_nothing(monkeypatch):
    engine = Engine(
        EngineConfig(
            preset="tiny-mamba", page_size=16, chunked_prefill_size=64, max_running_requests=8, warmup=True
        )
    )
    compiled = engine.runner.num_compiled()  # 0 if an earlier test compiled the same programs
    assert compiled <= len(engine.builder.warmup_shapes())
    rng = np.random.RandomState(0)
    for wave in range(3):  # prompt lengths 1..150, batch sizes 1..8, chunked and not
        for _ in range(rng.randint(1, 9)):
            n = int(rng.randint(1, 150))
            engine.add_request(
                input_ids=rng.randint(3, 500, n).tolist(),
                sampling_params={"max_new_tokens": int(rng.randint(1, 12)), "temperature": 0.7, "seed": wave},
            )
        while engine.has_unfinished():
            engine.step()
    assert engine.stats["steps"] > 20
    assert engine.runner.num_compiled() == compiled, "a request shape escaped the buckets"
