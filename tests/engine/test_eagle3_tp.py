"""An EAGLE-3 draft (``--speculative_algorithm EAGLE3``) at ``tp_size=4`` on the emulated CPU
devices, over the ``tiny`` preset (4 query heads, one per device; 2 KV heads, replicated
twice, the draft's as the model's):

- the draft's weights are split as a main layer's (``layers/eagle3.param_spec``) and its
  KV entry (one more cache layer) by KV head as the others are;
- every draft the tp-4 step program hands the engine equals the cache-free recompute on
  the same weights at ``tp_size=1`` (``reference_drafts``), under load: concurrent greedy
  requests, a pool small enough to retract, L2 on; half the requests have their drafts
  replaced by the true continuation (``Checked``), so drafts are accepted and the next
  ones are drafted from the last accepted row;
- greedy outputs and their logprobs equal a cache-free greedy recompute at ``tp_size=1``
  (the model the engine builds at tp 1, the draft attached as it attaches it);
- a draft whose query heads ``tp_size`` cannot split is refused, naming the flag and both
  numbers."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.engine.build import attach_drafter, load_model_and_tokenizer
from hicache_jax.engine.engine import Engine
from hicache_jax.models.sharding import kv_heads_on_device
from tests.engine.test_speculative_mtp import DRAFT, ROWS, WIDTH, Checked, eagle3_checkpoint, one_sequence
from tests.models.test_eagle3 import draft_config, draft_tensors
from tests.models.test_mtp_families import write

TP = 4
SETTINGS = dict(
    preset="tiny",
    page_size=16,
    chunked_prefill_size=16,  # one-page chunks: few step shapes to compile
    max_running_requests=4,
    max_total_tokens=8 * 16,  # 4 requests of 36 to 73 tokens: some are retracted
    dtype="float32",
    speculative_algorithm="EAGLE3",
    speculative_num_draft_tokens=WIDTH,
    enable_hierarchical_cache=True,  # retracted prefixes come back from L2
    hicache_ratio=2.0,
)


def workload():
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 500, rng.randint(20, 50)).tolist() for _ in range(4)]
    params = [{"max_new_tokens": int(rng.randint(16, 24)), "temperature": 0.0, "ignore_eos": True}] * 4
    return prompts, params


def run(engine: Engine, prompts, params) -> list[dict]:
    rids = [
        engine.add_request(input_ids=p, sampling_params=sp, return_logprob=True)
        for p, sp in zip(prompts, params)
    ]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return [engine.pop_output(r) for r in rids]


@functools.partial(jax.jit, static_argnums=0)
def _log_probs(model, ids, row):
    cache = model.allocate_cache(num_pages=1, page_size=ROWS, num_state_slots=1)
    return jax.nn.log_softmax(model(cache, one_sequence(model.cfg, ids, row))[1][0])


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after ``prompt`` and their logprobs, each from the whole sequence."""
    ids, out, lps = np.zeros(ROWS, np.int32), [], []
    ids[: len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n):
        lp = np.asarray(_log_probs(model, ids, i - 1))
        out.append(int(lp.argmax()))
        lps.append(float(lp[out[-1]]))
        ids[i] = out[-1]
    return out, lps


def test_eagle3_drafts_and_outputs_at_tp4_equal_tp1(tmp_path):
    draft = eagle3_checkpoint(str(tmp_path / "draft"))
    prompts, params = workload()
    one = EngineConfig(speculative_draft_model_path=draft, **SETTINGS)
    model, _ = load_model_and_tokenizer(one)  # the engine's model at tp 1, its draft attached
    attach_drafter(one, model)
    want = [greedy(model, p, sp["max_new_tokens"]) for p, sp in zip(prompts, params)]

    engine = Engine(EngineConfig(tp_size=TP, speculative_draft_model_path=draft, **SETTINGS))
    block = engine.model.mtp[0]
    q, k = block.attn.q_proj.kernel[...], block.attn.k_proj.kernel[...]
    assert q.sharding.shard_shape(q.shape) == (2 * DRAFT.h, DRAFT.heads * DRAFT.d // TP)
    assert k.sharding.shard_shape(k.shape) == k.shape  # 2 KV heads < 4 devices: whole
    assert block.attn.kv_repeat == TP // DRAFT.kv_heads
    kv = engine.runner.cache[-1].k  # [pages, page_size, kv_heads on device, head_dim]
    assert kv.shape[2] == kv_heads_on_device(engine.model.cfg, TP)
    assert kv.sharding.shard_shape(kv.shape)[2] == 1
    truth = [{"output_ids": ids} for ids, _ in want]
    engine.drafter = drafter = Checked(model, prompts, truth)  # drafts: the tp-1 recompute's
    try:
        got = run(engine, prompts, params)
    finally:
        engine.close()
    for (ids, lps), g in zip(want, got):
        assert g["output_ids"] == ids
        np.testing.assert_allclose([x[0] for x in g["meta_info"]["output_token_logprobs"]], lps, atol=2e-4)
    assert engine.scheduler.num_retractions > 0
    assert drafter.checked > 20
    st = engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st


def test_a_draft_whose_heads_tp_cannot_split_is_refused(tmp_path):
    w = DRAFT._replace(heads=6)  # 6 query heads over the model's 2 KV heads: fits tp 1 and 2
    path = write(str(tmp_path / "heads6"), draft_tensors(w=w), draft_config(w=w))
    cfg = EngineConfig(tp_size=TP, speculative_draft_model_path=path, **SETTINGS)
    with pytest.raises(
        ConfigError, match="speculative_draft_model_path=.*tp_size=4.*num_heads=6 is not a mul"
    ):
        Engine(cfg)
