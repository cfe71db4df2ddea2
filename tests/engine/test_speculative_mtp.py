"""Drafting with the model's multi-token-prediction block (``--speculative_algorithm
NEXTN``, ``runtime/mtp_drafts.py``), for MLA, DSA, a Gated DeltaNet hybrid and DeepSeek V4
(the founding document's model, its compressors rolled back after rejections), and with an
EAGLE-3 draft checkpoint in its place (``EAGLE3``) over Gemma 3:

- every draft the step program hands the engine equals a recomputation: the main model's
  final-norm output over the request's whole sequence, then the block over it and chained
  on its own outputs, with no cache (``reference_drafts``);
- under load (concurrent requests, a pool small enough to retract, L2 and a TensorStore L3
  on), and again after L1 and L2 are flushed, so the second pass's prompts come back from
  L3: the block's KV travels with the pages, or the drafts read through them differ;
- outputs equal decoding without speculation, every request's top logprobs included (each
  asks for them: every step computes them, so each step shape is one program).

Random weights almost never make the block's draft the model's next token, so half the
requests have their drafts replaced by the true continuation (one token of it corrupted
half the time): the step then accepts drafts, and the block must draft from the last
accepted row (``accepted_rows``) for the next drafts to equal the recomputation. The
prompts share no prefix (a page's last position holds the block's KV for the token after
the page, which a request sharing the page need not have: ``mtp_drafts.py``).

A step of decodes may hold a one-token chunk that does not end its prompt, and verify: the
block must then read the prompt's next token after that row, not the token sampled there
(``test_a_verify_step_holding_a_prompt_chunk`` makes the schedule that does it)."""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.models.batch import ForwardBatch, page_groups
from hicache_jax.speculative.drafters import MtpDrafter
from tests.engine.test_speculative import BASE, assert_same, corrupted, run
from tests.models.steps import one_page_batch
from tests.models.test_eagle3 import Widths, draft_config, draft_tensors
from tests.models.test_mtp_families import write

WIDTH = 4
ROWS = 256  # the recomputation's padded length (one program for every length)


def workload(seed: int = 0):
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(3, 500, rng.randint(20, 70)).tolist() for _ in range(8)]
    params = []
    for i in range(8):
        sp = {"max_new_tokens": int(rng.randint(8, 24)), "seed": i, "ignore_eos": True}
        sp.update(temperature=0.9, top_k=40) if i % 3 else sp.update(temperature=0.0)
        params.append(sp)
    return prompts, params


def one_sequence(cfg, ids: jax.Array, row) -> ForwardBatch:
    """``ROWS`` positions of one sequence in one page, logits at ``row``."""
    return one_page_batch(page_groups(cfg.cache_layer_kinds), ids, jnp.reshape(row, (1,)))


@functools.partial(jax.jit, static_argnums=0)
def _main_hidden(model, ids):
    cache = model.allocate_cache(num_pages=1, page_size=ROWS, num_state_slots=1)
    return model(cache, one_sequence(model.cfg, ids, 0), hidden=True)[2]


@functools.partial(jax.jit, static_argnums=0)
def _block(model, hidden, nxt, row):
    cache = model.allocate_cache(num_pages=1, page_size=ROWS, num_state_slots=1)
    entry = cache[len(model.layers)]
    batch = one_sequence(model.cfg, nxt, row)
    _, out, logits = model.mtp[0](entry, hidden, batch, model.embed, model.unembed)
    return out[row], jnp.argmax(logits[0]).astype(jnp.int32)


def reference_drafts(model, tokens: list[int], k: int) -> list[int]:
    """The ``k`` drafts after ``tokens`` (its last one sampled, not yet fed), recomputed:
    the block at each fed position ``i`` reads the main model's output there and token
    ``i + 1``; draft ``j + 1`` reads the block's output for draft ``j`` and draft ``j``."""
    m = len(tokens) - 1  # fed positions 0..m-1
    ids = np.zeros(ROWS, np.int32)
    ids[:m] = tokens[:m]
    hidden = _main_hidden(model, jnp.asarray(ids))
    if hidden.shape[-1] != model.cfg.hidden_size:  # EAGLE-3: its fc over the three states first
        hidden = model.mtp[0].fc(hidden)
    nxt = np.zeros(ROWS, np.int32)
    nxt[:m] = tokens[1:]
    out = []
    for j in range(k):
        h, d = _block(model, hidden, jnp.asarray(nxt), jnp.int32(m - 1 + j))
        out.append(int(d))
        hidden = hidden.at[m + j].set(h)
        nxt[m + j] = int(d)
    return out


class Checked(MtpDrafter):
    """The block's drafts, each checked against ``reference_drafts``; for even-numbered
    prompts then replaced by the true continuation, a token corrupted half the time."""

    def __init__(self, model, prompts, want, seed: int = 1):
        self.model, self.rng = model, random.Random(seed)
        self.truth = {tuple(p): (i, w["output_ids"]) for i, (p, w) in enumerate(zip(prompts, want))}
        self.checked = 0

    def __call__(self, req, k: int) -> list[int]:
        proposed = list(req.drafter_state or ())
        if proposed:
            ref = reference_drafts(self.model, req.input_ids + req.output_ids, len(proposed))
            assert proposed == ref, (req.rid, len(req.output_ids), proposed, ref)
            self.checked += 1
        i, truth = self.truth[tuple(req.input_ids)]
        if i % 2:
            return proposed[:k]
        return corrupted(truth, len(req.output_ids), k, self.rng)


# (preset, algorithm): the MTP block of DeepSeek V3 (MLA), GLM-5 (DSA), Qwen3.5 (a GDN
# hybrid) and DeepSeek V4; an EAGLE-3 draft over Gemma 3 (sliding and full attention).
DRAFTERS = [
    ("tiny-mla-mtp", "NEXTN"),
    ("tiny-dsa-mtp", "NEXTN"),
    ("tiny-qwen3.5-mtp", "NEXTN"),
    ("tiny-dsv4-mtp", "NEXTN"),  # DeepSeek V4's block: a window layer over the residual streams
    ("tiny", "EAGLE3"),
]
# An EAGLE-3 draft for the tiny presets' widths, reading the residual stream after layers 1,
# 1 and 2 (boundaries 2, 2, 3: explicit layer ids, read as SGLang reads them).
DRAFT = Widths(h=64, heads=4, kv_heads=2, d=16, inter=96, vocab=512, draft_vocab=200)


def eagle3_checkpoint(folder) -> str:
    config = draft_config(w=DRAFT) | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}
    return write(folder, draft_tensors(w=DRAFT), config)


@pytest.mark.parametrize("preset,algorithm", DRAFTERS)
def test_drafts_equal_a_recomputation_through_every_tier(preset, algorithm, tmp_path):
    prompts, params = workload()
    want = run(Engine(EngineConfig(preset=preset, **BASE)), prompts, params, all_tops=True)
    draft = eagle3_checkpoint(str(tmp_path / "draft")) if algorithm == "EAGLE3" else None
    cfg = EngineConfig(
        preset=preset,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft,
        speculative_num_draft_tokens=WIDTH,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_storage_backend="tensorstore",
        hicache_storage_spec=str(tmp_path / "l3"),
        hicache_write_policy="write_through",  # every page reaches L3
        hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=16,  # a page: the prompts are short
        **BASE,
    )
    engine = Engine(cfg)
    assert engine.model.cfg.mtp_cache_layers == 1
    assert len(engine.runner.cache) == engine.model.cfg.num_layers + 1  # the drafter's KV
    engine.drafter = drafter = Checked(engine.model, prompts, want)
    try:
        got = run(engine, prompts, params, all_tops=True)
        assert_same(want, got)
        assert engine.scheduler.num_retractions > 0, "the pool was meant to force retractions"
        first = drafter.checked
        assert first > 20
        engine.flush_cache()  # L1 and L2: the second pass's prompts come from L3
        again = run(engine, prompts[:4], params[:4], all_tops=True)
    finally:
        engine.close()
    assert_same(want[:4], again)
    assert drafter.checked > first
    assert sum(g["meta_info"]["cached_tokens_details"].get("storage", 0) for g in again) > 0
    st = engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st


class VerifiedChunks:
    """Counts the verify steps holding a chunk that does not end its prompt (the engine's
    batch builder is wrapped to see each step's plan)."""

    def __init__(self, engine: Engine):
        self.count, build = 0, engine.builder.build

        def watched(plan, **kw):
            self.count += plan.verify and any(not item.samples for item in plan.items)
            return build(plan, **kw)

        engine.builder.build = watched


# The batch builder's rows are the same for every drafter: one preset, whose drafts differ
# from the recomputation at C's first draft when the block reads the token sampled there.
@pytest.mark.parametrize("preset", ["tiny-qwen3.5-mtp"])
def test_a_verify_step_holding_a_prompt_chunk(preset):
    """One-page chunks: prompts A, B, C of 24, 25 and 40 tokens, queued in that order, each
    taking what the older ones leave of a step's 16 tokens (a decode takes none), and never
    past the end of a page. C's chunk in step 4 stops one token short of its page's end, so
    its next chunk is that one token, in a step where A and B decode and nobody waits to
    take the rest of the budget: a verify step.

        step 1  A [0, 16)
        step 2  A [16, 24) samples      B [0, 8)
        step 3  A decodes               B [8, 16)            C [0, 8)
        step 4  A decodes               B [16, 25) samples   C [8, 15)
        step 5  A, B verify drafts                           C [15, 16): its row samples,
                                                               but the token after it is C's 17th

    The block's KV at C's position 15 is then read by every draft C makes, and the row's
    prompt logprob scores C's 17th token (every request asks for prompt logprobs)."""
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 500, n).tolist() for n in (24, 25, 40)]
    params = [
        {"max_new_tokens": m, "seed": i, "ignore_eos": True, "temperature": 0.0}
        for i, m in enumerate((10, 10, 20))
    ]
    base = BASE | {"chunked_prefill_size": BASE["page_size"]}
    want = run(Engine(EngineConfig(preset=preset, **base)), prompts, params, True, logprob_start_len=0)
    cfg = EngineConfig(
        preset=preset, speculative_algorithm="NEXTN", speculative_num_draft_tokens=WIDTH, **base
    )
    engine = Engine(cfg)
    engine.drafter = drafter = Checked(engine.model, prompts, want)
    chunks = VerifiedChunks(engine)
    got = run(engine, prompts, params, True, logprob_start_len=0)
    assert_same(want, got)
    for a, b in zip(want, got):
        lp_a = [x[0] for x in a["meta_info"]["input_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["input_token_logprobs"]]
        assert len(lp_b) == len(lp_a) and lp_a[0] is None
        np.testing.assert_allclose(lp_b[1:], lp_a[1:], atol=2e-4)
    assert chunks.count > 0 and drafter.checked > 0, (chunks.count, drafter.checked)


def test_nextn_needs_mtp_blocks():
    with pytest.raises(ConfigError, match="speculative_algorithm.*multi-token-prediction blocks"):
        Engine(EngineConfig(preset="tiny-mla", speculative_algorithm="NEXTN"))


def test_an_eagle3_draft_that_does_not_fit_is_refused(tmp_path):
    fits = eagle3_checkpoint(str(tmp_path / "fits"))
    narrow = write(str(tmp_path / "narrow"), draft_tensors(), draft_config())  # hidden 32, vocab 96
    for preset, path, message in [
        ("tiny-mla", fits, "cannot share the model's pages: the target .* has no full attention pages"),
        ("tiny", narrow, "the draft's hidden_size is 32 but the target's .* is 64"),
    ]:
        cfg = EngineConfig(preset=preset, speculative_algorithm="EAGLE3", speculative_draft_model_path=path)
        with pytest.raises(ConfigError, match="speculative_draft_model_path.*" + message):
            Engine(cfg)
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*EAGLE3"):
        EngineConfig(speculative_algorithm="EAGLE3")
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*EAGLE3"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_draft_model_path=fits)
