"""Grammar-constrained requests in the engine: under memory pressure (retractions, a pool
of a few pages, every tier on) each constrained output validates and equals the request's
solo run; a grammar dead end finishes its request with a clear reason, its pages freed."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["id", "tag", "words"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|[a-z]{2,4}-[0-9]{1,3})"


def run(engine: Engine, prompts, params) -> list[dict]:
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return [engine.pop_output(r) for r in rids]


def test_constrained_outputs_under_pressure(tmp_path):
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 500, rng.randint(20, 60)).tolist() for _ in range(10)]
    params = []
    for i in range(10):
        sp = {"max_new_tokens": 80, "temperature": [0.0, 1.0][i % 2], "seed": i}
        if i % 3 == 0:
            sp["json_schema"] = json.dumps(SCHEMA)
        elif i % 3 == 1:
            sp["regex"] = REGEX
        params.append(sp)
    base = dict(preset="tiny", page_size=16, chunked_prefill_size=32, warmup=False, max_running_requests=6)
    tight = Engine(
        EngineConfig(
            **base,
            max_total_tokens=10 * 16,
            enable_hierarchical_cache=True,
            hicache_ratio=2.0,
            hicache_storage_backend="tensorstore",
            hicache_storage_spec=str(tmp_path / "l3"),
        )
    )
    solo = Engine(EngineConfig(**base, max_total_tokens=64 * 16, disable_radix_cache=True))
    try:
        outs = run(tight, prompts, params)
        assert tight.scheduler.num_retractions > 0, "the pool was meant to be too small"
        for i, (prompt, sp, out) in enumerate(zip(prompts, params, outs)):
            if "json_schema" in sp:
                jsonschema.validate(json.loads(out["text"]), SCHEMA)
            elif "regex" in sp:
                assert re.fullmatch(REGEX, out["text"]), out["text"]
            else:
                continue
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
            alone = run(solo, [prompt], [sp])[0]
            assert out["output_ids"] == alone["output_ids"], f"request {i} changed under pressure"
        tight.flush_cache()
        tight.check_integrity()
    finally:
        tight.close()


def test_dead_end_finishes_the_request():
    engine = Engine(EngineConfig(preset="tiny", warmup=False, max_running_requests=4))
    rid = engine.add_request(input_ids=[5, 6, 7], sampling_params={"regex": "ab", "max_new_tokens": 8})
    other = engine.add_request(input_ids=[5, 6, 8], sampling_params={"max_new_tokens": 4, "temperature": 0})
    matcher = engine.requests[rid].grammar.matcher
    bad = engine.tokenizer.encode("zz", add_special_tokens=False)[0]
    assert not matcher.consume_token(bad)  # the matcher is now in error: no token continues it
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["message"].startswith("grammar dead end"), reason
    assert out["output_ids"] == []
    assert len(engine.pop_output(other)["output_ids"]) == 4  # its batch mate is unaffected
    engine.flush_cache()
    engine.check_integrity()
