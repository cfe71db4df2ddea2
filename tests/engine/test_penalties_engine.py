"""Penalties and ``min_new_tokens`` through the engine, under load: concurrent requests on a
pool small enough to retract some (a retracted request may lose its penalty slot and get its
counts back from the host), every penalty mixed with plain rows.

- greedy rows equal a recompute: transformers' logits for the sequence so far, the numpy
  definitions of ``tests/runtime/test_penalties.py``, argmax (a first difference must be a near-tie
  in the penalised reference logits, as in ``test_engine_greedy.py``);
- seeded sampled rows equal their solo runs;
- nothing leaks: no page, no penalty slot.
"""

import numpy as np
import torch

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from tests.hf_checkpoints import load_reference
from tests.runtime.test_penalties import numpy_penalised

NEW = 12


def run(engine, prompts, params):
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return [engine.pop_output(r)["output_ids"] for r in rids]


def recompute(ref, prompt, sp, eos, new):
    """Greedy tokens from transformers' logits and the numpy definitions."""
    out, stops = [], list(sp.get("stop_token_ids", [])) + list(eos)
    for _ in range(new):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        x = numpy_penalised(
            logits,
            prompt,
            out,
            sp.get("repetition_penalty", 1.0),
            sp.get("frequency_penalty", 0.0),
            sp.get("presence_penalty", 0.0),
            sp.get("min_new_tokens", 0),
            stops,
        )
        top2 = np.sort(x)[-2:]
        out.append(int(x.argmax()))
        yield out[-1], top2[1] - top2[0]
        if out[-1] in stops and len(out) >= sp.get("min_new_tokens", 0):
            return


def test_penalties_under_pressure(checkpoint_dir):
    path = checkpoint_dir("mistral")
    ref = load_reference(path)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 64, rng.randint(8, 40)).tolist() for _ in range(8)]  # small ids: repeats
    first = {}  # each prompt's plain greedy first token: held back by min_new_tokens below
    for i, p in enumerate(prompts):
        with torch.no_grad():
            first[i] = int(ref(torch.tensor([p])).logits[0, -1].argmax())
    kinds = [
        {"repetition_penalty": 1.4},
        {"frequency_penalty": 0.9, "presence_penalty": 0.6},
        {"repetition_penalty": 0.8, "presence_penalty": -0.4, "temperature": 0.9, "seed": 5},
        {},
        {"min_new_tokens": 4},  # + its first token as a stop token
        {"frequency_penalty": 2.0, "repetition_penalty": 1.2, "min_new_tokens": 3},
        {"presence_penalty": 1.5, "temperature": 0.7, "top_k": 20, "seed": 9},
        {"repetition_penalty": 2.0},
    ]
    params = []
    for i, k in enumerate(kinds):
        sp = {"max_new_tokens": NEW, "temperature": 0.0, **k}
        if "min_new_tokens" in k:
            sp["stop_token_ids"] = [first[i]]
        params.append(sp)
    base = dict(
        model_path=path,
        dtype="float32",
        page_size=16,
        chunked_prefill_size=32,
        max_running_requests=4,
        max_total_tokens=8 * 16,
    )
    solo = Engine(EngineConfig(**base, disable_radix_cache=True))
    tight = Engine(EngineConfig(**base))
    outs = run(tight, prompts, params)
    assert tight.scheduler.num_retractions > 0, "the pool was meant to be too small"
    eos = tight.model.cfg.eos_token_ids
    for i, (prompt, sp, got) in enumerate(zip(prompts, params, outs)):
        if sp["temperature"] > 0:
            assert got == run(solo, [prompt], [sp])[0], f"request {i} changed under pressure"
            continue
        for k, (want, gap) in enumerate(recompute(ref, prompt, sp, eos, NEW)):
            if k >= len(got) or got[k] != want:
                assert gap < 1e-4, f"request {i} ({kinds[i]}): differs at {k} ({got} vs recompute), gap {gap}"
                break
        else:
            assert len(got) == k + 1, f"request {i}: {got} runs past the recompute's stop"
        if "min_new_tokens" in sp:
            assert first[i] not in got[: sp["min_new_tokens"]]
    assert not tight.penalty_slots.holders and not solo.penalty_slots.holders
    assert tight.flush_cache().success
    for pool in tight.prefix_cache.pools.values():
        assert pool.num_used == 0, f"{pool.name}: {pool.num_used} still in use after flush"
