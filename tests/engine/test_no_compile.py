"""No compile while serving: after ``Engine.warmup`` a varied stream (decode and prefill
buckets, 1 to max_running_requests sequences, input and top logprobs, Mamba state copies,
L2 loads and backups, L3 hits, penalties, a rebuild after a failed step) compiles nothing. Compiles
are counted through JAX's public monitoring events (``hicache_jax.runtime.compiles``)."""

import logging
import re

import numpy as np

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.request import Req
from hicache_jax.runtime import compiles, runner
from hicache_jax.runtime.batch_builder import BatchBuilder
from hicache_jax.sampling_params import SamplingParams
from hicache_jax.scheduler.plan import StepPlan, WorkItem

P = 16


def _plan(rng, max_running: int, max_prefill: int, width: int = 0) -> StepPlan:
    """A plan the scheduler could make: decodes, plus prefill chunks within the budget; with
    speculation (``width``), half the all-decode plans carry drafts."""
    items, budget = [], max_prefill
    for _ in range(rng.randint(1, max_running + 1)):
        n = int(rng.randint(1, 300))
        lsl = int(rng.randint(-1, n))
        req = Req(rid="r", input_ids=[3] * n, sampling=SamplingParams(), return_logprob=rng.rand() < 0.3)
        req.logprob_start_len = lsl
        if rng.rand() < 0.5 or budget == 0:  # decoding: one token past the prompt
            req.output_ids = [3] * int(rng.randint(1, 5))
            end = n + len(req.output_ids)
            items.append(WorkItem(req, end - 1, end))
        else:
            start = int(rng.randint(0, n))
            end = min(n, start + int(rng.randint(1, budget + 1)))
            budget -= end - start
            items.append(WorkItem(req, start, end))
    plan = StepPlan(items)
    if width > 1 and plan.decode_only and rng.rand() < 0.5:  # a verify step: drafts of 0..width-1
        for item in plan.items:
            k = int(rng.randint(0, width))
            item.draft, item.end = (3,) * k, item.end + k
    return plan


def test_warmup_shapes_cover_every_plan():
    rng = np.random.RandomState(0)
    for max_running, max_prefill, width in [(1, 16, 0), (3, 16, 4), (8, 64, 0), (8, 64, 5), (32, 512, 4)]:
        b = BatchBuilder(
            page_size=P,
            groups=("full",),
            max_running=max_running,
            max_prefill=max_prefill,
            max_pages=8,
            vocab_size=512,
            spec_width=width,
        )
        warm = set(b.warmup_shapes())
        assert len(warm) == len(b.warmup_shapes())
        seen = set()
        for _ in range(300):
            plan = _plan(rng, max_running, max_prefill, width)
            shape = b.shapes(plan)
            assert shape in warm, (max_running, max_prefill, width, shape)
            assert shape.verify == plan.verify
            seen.add(shape)
        assert len(seen) >= len(warm) // 2  # the plans are varied enough to mean something


def _requests(rng, lengths, sampling=None, **extra):
    for n in lengths:
        yield dict(
            input_ids=rng.randint(3, 500, n).tolist(),
            sampling_params={
                "max_new_tokens": int(rng.randint(1, 6)),
                "temperature": 0.7,
                "seed": n,
                **(sampling or {}),
            },
            **extra,
        )


def _run(engine, reqs, batch_sizes: set) -> list[dict]:
    rids = [engine.add_request(**r) for r in reqs]
    while engine.has_unfinished():
        engine.step()
        batch_sizes.add(len(engine.scheduler.running))
    return [engine.pop_output(r) for r in rids]


def test_serving_after_warmup_compiles_nothing(tmp_path, caplog):
    cfg = EngineConfig(
        preset="tiny-mamba",  # Mamba + full attention: state copies, page and state transfers
        page_size=8,  # chunks of one page: a single prefill bucket (T = 8 + 2), few programs
        chunked_prefill_size=8,
        max_running_requests=2,
        max_total_tokens=16 * 8,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_layerwise_pages=2,  # L2 loads: two pages of each in the step, the rest before it
        hicache_storage_backend="tensorstore",
        hicache_storage_spec=str(tmp_path / "l3"),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=0,
        warmup=True,
    )
    engine = Engine(cfg)
    rng = np.random.RandomState(0)
    first = list(_requests(rng, [100, 5, 50, 27, 90, 13]))
    sizes = set()
    logprobs = dict(return_logprob=True, logprob_start_len=3, top_logprobs_num=4)
    caplog.set_level(logging.WARNING, logger=runner.__name__)
    try:
        with compiles.Watch() as watch:
            outs = _run(engine, first, sizes)  # 1..2 running, long and short prompts, chunked
            outs += _run(engine, _requests(rng, [40]), sizes)  # alone
            penalised = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "min_new_tokens": 1}
            outs += _run(engine, _requests(rng, [30, 60], penalised), sizes)  # penalty rows written
            outs += _run(engine, _requests(rng, [70, 9], **logprobs), sizes)  # input and top logprobs
            outs += _run(engine, _requests(rng, [45], return_logprob=True), sizes)  # output logprobs only
            regex = {"regex": "[a-c]{2,5}", "max_new_tokens": 8}  # grammar-constrained rows
            mixed = list(_requests(rng, [35, 20], regex)) + list(_requests(rng, [25, 15], {"temperature": 0}))
            outs += _run(engine, mixed, sizes)  # beside unconstrained greedy and sampled rows
            constrained = outs[-4:-2]
            outs += _run(engine, _requests(rng, [100, 80, 70]), sizes)  # evicts `first` from the device
            outs += _run(engine, first[:3], sizes)  # L2 hits: host -> device loads
            host_hits = engine.stats["cached_tokens_host"]
            assert engine.flush_cache().success  # drains L3 writes, empties L1 and L2
            outs += _run(engine, first[3:], sizes)  # L3 hits: storage -> host -> device
            engine.recover()  # what a failed step does: fresh device cache arrays
            outs += _run(engine, [dict(first[0], **logprobs)], sizes)
    finally:
        engine.close()
    assert not watch.new, f"compiled while serving: {dict(watch.new)}"
    assert not [r for r in caplog.records if "waited" in r.getMessage()]  # no step said it waited
    # The stream did reach every path it claims to.
    assert host_hits > 0 and engine.stats["cached_tokens_storage"] > 0, engine.stats
    assert engine.prefix_cache.counters["host_backups"] > 0
    assert 0 < engine.stats["host_loads_layerwise"] < engine.prefix_cache.counters["host_loads"]
    assert {1, 2} <= sizes, sizes
    assert all(re.fullmatch("[a-c]{2,5}", o["text"]) for o in constrained), constrained
    assert any(o["meta_info"].get("input_top_logprobs") for o in outs)


def test_a_step_that_waits_on_its_compile_says_which_and_how_long(caplog):
    """Without warm-up, a shape's first step compiles it: one warning names the program (as
    warm-up names it) and the seconds; the same shape again says nothing."""
    cfg = EngineConfig(
        preset="tiny", page_size=8, chunked_prefill_size=8, max_running_requests=2, max_total_tokens=128
    )
    engine = Engine(cfg)
    caplog.set_level(logging.WARNING, logger=runner.__name__)
    rng = np.random.RandomState(1)
    try:
        _run(engine, _requests(rng, [5], {"max_new_tokens": 3}), set())
        first = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
        _run(engine, _requests(rng, [5], {"max_new_tokens": 3}), set())
    finally:
        engine.close()
    assert first and all(
        re.search(r"waited \d+\.\d s .*\((prefill|decode) step T=\d+ S=\d+ R=\d+ top=0;", m) for m in first
    ), first
    assert any("prefill step T=" in m for m in first) and any("decode step T=" in m for m in first), first
    again = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert again == first  # the second request ran programs compiled for the first


def test_speculative_serving_after_warmup_compiles_nothing(caplog):
    """With n-gram speculation, the served stream runs verify steps (drafts of 1 to 3
    tokens, beside requests drafting none, a penalised request among them, with and without
    top logprobs) and decode and prefill steps between them: after warm-up, none of them
    compiles."""
    cfg = EngineConfig(
        preset="tiny",
        page_size=8,
        chunked_prefill_size=8,
        max_running_requests=2,
        max_total_tokens=16 * 8,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        warmup=True,
    )
    engine = Engine(cfg)
    rng = np.random.RandomState(2)

    def repeats(cases, **extra):  # prompts that repeat a motif: the n-gram drafter finds matches
        for length, sampling in cases:
            motif = rng.randint(3, 500, int(rng.randint(3, 7))).tolist()
            prompt = (motif * 10)[:length]
            yield dict(
                input_ids=prompt,
                sampling_params={"max_new_tokens": 12, "seed": length, "ignore_eos": True, **sampling},
                **extra,
            )

    greedy, sampled = {"temperature": 0}, {"temperature": 0.8, "top_k": 8}
    penalised = {"temperature": 0, "repetition_penalty": 1.2}
    sizes = set()
    caplog.set_level(logging.WARNING, logger=runner.__name__)
    try:
        with compiles.Watch() as watch:
            _run(engine, repeats([(30, greedy), (21, sampled)]), sizes)
            _run(engine, repeats([(17, greedy)]), sizes)  # alone
            _run(engine, repeats([(25, greedy), (40, penalised)]), sizes)  # penalty rows
            logprobs = dict(return_logprob=True, top_logprobs_num=3)
            _run(engine, repeats([(19, greedy), (33, sampled)], **logprobs), sizes)  # top logprobs
    finally:
        engine.close()
    assert not watch.new, f"compiled while serving: {dict(watch.new)}"
    assert not [r for r in caplog.records if "waited" in r.getMessage()]
    assert engine.stats["spec_draft_tokens"] > 0, engine.stats
    assert {1, 2} <= sizes, sizes
