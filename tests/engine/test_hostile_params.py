"""One request's failure stays with that request.

- A property: hostile sampling parameters, stop lists and logprob settings (huge, negative
  and boundary integers, floats at and past float32's limits, odd unicode stop strings, long
  lists) beside a running victim request. Each hostile request is refused at
  ``add_request`` (``InvalidRequest``) or runs to a normal end; the victim's output equals
  its solo run; no step fails and no request fails alone (validation caught every value the
  step cannot hold); no page or penalty slot is left held.
- A row failure validation cannot catch (a value corrupted after it, a postprocessing error)
  fails that request alone, with a message naming the problem, also in a step planned
  ahead of the one in flight (the overlap schedule); the others finish with their solo
  outputs, and the device state is not rebuilt.
- The findings of issue 39 as unit cases: a stop id past int32 with ``min_new_tokens``
  (once an ``OverflowError`` in the batch builder that failed the whole step), ``top_p``
  that float32 rounds to 0, ``temperature`` that float32 rounds to inf.

One small engine (the tiny preset, overlap schedule on) serves every test here, so the
step programs compile once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hicache_jax.config import EngineConfig
from hicache_jax.engine import engine as engine_module
from hicache_jax.engine.engine import Engine
from hicache_jax.request import Req
from hicache_jax.runtime import batch_builder
from hicache_jax.runtime.batch_builder import BatchBuilder, RowFailed
from hicache_jax.sampling_params import FLOAT32_MAX, FLOAT32_TINY, InvalidRequest, SamplingParams, float32
from hicache_jax.scheduler.plan import StepPlan, WorkItem

V = 512  # the tiny preset's vocabulary
P = 16
VICTIM_PROMPT = np.random.RandomState(7).randint(3, V, 20).tolist()
VICTIM = {
    "input_ids": VICTIM_PROMPT,
    "sampling_params": {
        "max_new_tokens": 8,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 11,
        "ignore_eos": True,
    },
    "return_logprob": True,
    "top_logprobs_num": 2,
}


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(
        preset="tiny",
        page_size=P,
        chunked_prefill_size=32,
        max_running_requests=4,
        max_total_tokens=16 * P,
        warmup=False,
    )
    assert not cfg.disable_overlap_schedule
    return Engine(cfg)


def run_alone(engine: Engine, request: dict) -> dict:
    rid = engine.add_request(**request)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid)
    assert engine.flush_cache().success
    return out


@pytest.fixture(scope="module")
def victim_solo(engine):
    return run_alone(engine, VICTIM)


def assert_same_output(got: dict, want: dict) -> None:
    """The same tokens, finish reason and logprobs (to float32 rounding: the batch's
    composition may move the last bits)."""
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        a, b = got["meta_info"].get(key), want["meta_info"].get(key)
        assert (a is None) == (b is None), key
        flat_a, flat_b = np.asarray(_floats(a)), np.asarray(_floats(b))
        assert flat_a.shape == flat_b.shape and np.allclose(flat_a, flat_b, atol=1e-5), key
        assert _ids(a) == _ids(b), key


def _floats(x) -> list[float]:
    if isinstance(x, float):
        return [x]
    return [f for v in x for f in _floats(v)] if isinstance(x, list) else []


def _ids(x) -> list:
    if isinstance(x, list):
        return [_ids(v) for v in x if not isinstance(v, float)]
    return x


# ---- hostile values ----------------------------------------------------------------------
INTS = [-1, 0, 1, 2, V - 1, V, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, -(2**31), -(2**63) - 1, 10**30]
FLOATS = [
    0.0, -0.0, 0.5, 1.0, 2.0, -2.0, 1e-300, 5e-324, 2.2250738585072014e-308, 1e-45, FLOAT32_TINY,
    FLOAT32_TINY / 2, 1e-38, 1e-5, 0.9999999999, 1.0000001, 2.0000001, 1e308, 3.4e38, FLOAT32_MAX,
    3.5e38, math.nan, math.inf, -math.inf, 2**31, 10**400,
]  # fmt: skip
ODD_STOPS = ["\x00", "\ud800", "\U0001f600", "\u202e", "\n", " ", "a" * 2000, "租", "\ufffd", "<|eos|>"]


def hostile_int(*edges):
    return st.sampled_from(INTS) | st.sampled_from(edges)


def hostile_float(*edges):
    """Half the time a value from anywhere, half the time an edge the field accepts."""
    return st.sampled_from(FLOATS) | st.floats() | st.sampled_from(edges) | st.sampled_from(edges)


FIELDS = {
    "max_new_tokens": hostile_int(1, 2, 4),
    "min_new_tokens": hostile_int(1, 2),
    "temperature": hostile_float(0.7, -0.0, 1e-6, 5e-324, FLOAT32_MAX, 2**31),
    "top_p": hostile_float(FLOAT32_TINY, 0.3, 0.9999999999),
    "top_k": hostile_int(3, 40),
    "min_p": hostile_float(5e-324, 0.05, 1.0),
    "seed": hostile_int(5, None, 2**64 - 1, -(2**63)),
    "frequency_penalty": hostile_float(-2.0, 2.0, 1e-45, 0.5),
    "presence_penalty": hostile_float(-2.0, 2.0, 1e-45, 0.5),
    "repetition_penalty": hostile_float(1e-6, 2.0, 0.5),
    "stop_token_ids": st.lists(st.sampled_from(INTS) | st.integers(0, V - 1), max_size=40)
    | st.just(list(range(V))),
    "stop": st.sampled_from(ODD_STOPS)
    | st.lists(st.sampled_from(ODD_STOPS) | st.text(max_size=8), max_size=60),
    "ignore_eos": st.sampled_from([True, False, 0, None]),
    "skip_special_tokens": st.sampled_from([True, False, "no"]),
    "n": st.sampled_from([1, 2, 0]),
    "regex": st.sampled_from(["[a-z]{1,4}", ""]),
    "json_schema": st.just('{"type": "object", "properties": {"a": {"type": "integer"}}}'),
}


def request(sp: dict, **kw) -> dict:
    return {"input_ids": [7, 8, 9, 10, 11], "sampling_params": {"max_new_tokens": 3} | sp} | kw


# The boundaries, every time: values just inside the step's limits run, just past them are refused.
INSIDE = [
    request({"top_p": FLOAT32_TINY, "temperature": FLOAT32_MAX, "top_k": 2**31 - 1, "seed": 2**64 - 1}),
    request({"min_new_tokens": 2, "stop_token_ids": [V - 1, 0, 1, 2], "repetition_penalty": 1e-6}),
    request(
        {"stop": ["\ud800", "a" * 2000, "\x00"], "min_p": 5e-324, "temperature": 5e-324, "seed": -(2**63)}
    ),
    request({"frequency_penalty": -2.0, "presence_penalty": 2.0, "stop_token_ids": list(range(V))}),
    request(
        {"top_k": V, "top_p": 1.0, "min_p": 1.0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=20,
    ),
]
PAST = [
    request({"min_new_tokens": 1, "stop_token_ids": [2**31]}),  # finding 2
    request({"top_p": 1e-300}),  # finding 6
    request({"temperature": 1e308}),  # finding 6
    request({"stop_token_ids": [V]}),
    request({"max_new_tokens": 2**31, "min_new_tokens": 2**31}),
    request({"repetition_penalty": 1e-300}),
    request({}, return_logprob=True, top_logprobs_num=21),
]


@st.composite
def hostile_requests(draw):
    """A request with a few hostile fields (the rest benign, so that many of them run)."""
    if draw(st.booleans()):  # shares a prefix with the victim: its pages meet the victim's
        prompt = VICTIM_PROMPT[: draw(st.integers(1, len(VICTIM_PROMPT)))]
    else:
        prompt = []
    prompt = prompt + draw(st.lists(st.integers(3, V - 1), min_size=1, max_size=24))
    sp = {"max_new_tokens": 3}
    for name in draw(st.permutations(sorted(FIELDS)))[: draw(st.integers(1, 3))]:
        sp[name] = draw(FIELDS[name])
    kw = {"input_ids": prompt, "sampling_params": sp}
    if draw(st.booleans()):
        kw["return_logprob"] = draw(st.sampled_from([True, False, 1]))
        kw["logprob_start_len"] = draw(
            st.sampled_from([-1, 0, 1, len(prompt) - 1, len(prompt), 2**31, -2, True])
        )
        kw["top_logprobs_num"] = draw(st.sampled_from([0, 1, 20, 21, -1, 2**63, True]))
    return kw


def run_with_victim(engine: Engine, hostile: list[tuple[int, dict]]) -> tuple[dict, list]:
    """The victim and the hostile requests (each added at its step); returns the victim's
    output and, per hostile request, its output or the InvalidRequest that refused it."""
    victim = engine.add_request(**VICTIM)
    rids: list = [None] * len(hostile)
    step = 0
    while True:
        for i, (at, request) in enumerate(hostile):
            if at == step:
                try:
                    rids[i] = engine.add_request(**request)
                except InvalidRequest as e:
                    rids[i] = e
        if not engine.has_unfinished() and step > max(at for at, _ in hostile):
            break
        engine.step()  # a StepFailed here fails the test
        step += 1
    outs = [r if isinstance(r, InvalidRequest) else engine.pop_output(r) for r in rids]
    return engine.pop_output(victim), outs


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(hostile=st.lists(st.tuples(st.integers(0, 3), hostile_requests()), min_size=1, max_size=3))
@example(hostile=[(i % 4, r) for i, r in enumerate(INSIDE[:3] + PAST)])
@example(hostile=[(i % 4, r) for i, r in enumerate(INSIDE[3:] + PAST)])
def test_hostile_requests_never_hurt_a_victim(engine, victim_solo, hostile):
    before = dict(engine.stats)
    victim, outs = run_with_victim(engine, hostile)
    assert_same_output(victim, victim_solo)
    assert engine.stats["failed_steps"] == before["failed_steps"]
    # Every value that reached a step fit it: validation refused the rest.
    assert engine.stats["request_errors"] == before["request_errors"], outs
    for (_, sent), out in zip(hostile, outs):
        if any(sent is r for r in INSIDE):
            assert isinstance(out, dict), f"refused: {out}"
        if any(sent is r for r in PAST):
            assert isinstance(out, InvalidRequest), f"not refused: {sent}"
        if isinstance(out, dict):
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] in ("stop", "length") or "grammar dead end" in reason["message"], reason
    assert not engine.penalty_slots.holders, "a penalty slot was left held"
    assert engine.flush_cache().success  # every page free again (flush checks for leaks)
    engine.check_integrity()


# ---- a row failure validation cannot catch ------------------------------------------------
OTHERS = [
    {
        "input_ids": [5, 9, 33, 7] * 5,
        "sampling_params": {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True},
    },
    {
        "input_ids": [44, 3, 101] * 9,
        "sampling_params": {"max_new_tokens": 9, "temperature": 1.0, "seed": 3, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 1,
    },
]
CONSTRAINED_TARGET = {
    "input_ids": list(range(40, 70)),
    "sampling_params": {"regex": "[a-z]{1,20}", "max_new_tokens": 12, "temperature": 0.7, "seed": 4},
}
TARGET = {
    "input_ids": list(range(40, 70)),
    "sampling_params": {
        "max_new_tokens": 12,
        "min_new_tokens": 1,
        "temperature": 0.7,
        "seed": 4,
        "ignore_eos": True,
    },
}


@pytest.mark.parametrize(
    "where", ["build, admitted", "build, planned ahead", "build, grammar mask", "postprocess"]
)
def test_a_failing_row_fails_its_request_alone(engine, victim_solo, monkeypatch, where):
    others = [VICTIM, *OTHERS]
    if where == "build, grammar mask":  # a constrained neighbour, its masks filled beside the target's
        others = [VICTIM, request({"regex": "(yes|no) [a-z]{6,9}", "max_new_tokens": 12, "temperature": 0})]
    solo = [run_alone(engine, r) for r in others]
    assert_same_output(solo[0], victim_solo)
    rebuilt = []
    monkeypatch.setattr(engine, "recover", lambda: rebuilt.append(True))
    before = dict(engine.stats)
    rids = [engine.add_request(**r) for r in others]
    target = engine.add_request(**(CONSTRAINED_TARGET if where == "build, grammar mask" else TARGET))
    req = engine.requests[target]

    def corrupt():  # a value validation refuses, past it: int32 cannot hold it
        object.__setattr__(req.sampling, "stop_token_ids", (2**31,))

    if where == "build, admitted":
        corrupt()
        expect = "sampling_params.stop_token_ids: cannot be packed into the step (OverflowError"
    elif where == "build, planned ahead":
        # Corrupted with a decode step in flight: the next step is planned before it is read.
        while not (
            engine._inflight is not None and engine._inflight.plan.decode_only and len(req.output_ids) >= 2
        ):
            engine.step()
        corrupt()
        ahead = engine.stats["overlapped_steps"]
        engine.step()
        assert engine.stats["overlapped_steps"] == ahead + 1, "the failing step was not planned ahead"
        assert req.finished
        expect = "sampling_params.stop_token_ids: cannot be packed into the step (OverflowError"
    elif where == "build, grammar mask":
        real_fill = batch_builder.fill_masks

        def fill_masks(rows, allowed):  # llguidance fills every row at once: one bad row fails the call
            if any(c is req.grammar for c, _ in rows):
                raise RuntimeError("a mask that cannot be computed")
            real_fill(rows, allowed)

        monkeypatch.setattr(batch_builder, "fill_masks", fill_masks)
        expect = "sampling_params.regex: cannot be packed into the step (RuntimeError: a mask that cannot be"
    else:
        real = engine_module.stop_reason

        def stop_reason(r: Req, tok: int, **kw):
            if r is req and len(r.output_ids) >= 3:
                raise ValueError("a stop check that raises")
            return real(r, tok, **kw)

        monkeypatch.setattr(engine_module, "stop_reason", stop_reason)
        expect = "postprocessing its step failed: ValueError: a stop check that raises"
    while engine.has_unfinished():
        engine.step()
    failed = engine.pop_output(target)
    reason = failed["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["message"].startswith(expect), reason
    for rid, want in zip(rids, solo):
        assert_same_output(engine.pop_output(rid), want)
    assert engine.stats["request_errors"] == before["request_errors"] + 1
    assert engine.stats["failed_steps"] == before["failed_steps"]
    assert not rebuilt and engine.broken is None, "the device state was rebuilt"
    assert engine.prefix_cache.pools["full"].num_used > 0, "L1 was emptied (a rebuild drops it)"
    assert not engine.penalty_slots.holders
    assert engine.flush_cache().success
    engine.check_integrity()


# ---- the findings, as unit cases --------------------------------------------------------
def test_a_stop_id_past_int32_with_min_new_tokens_is_refused(engine):
    """Finding 2: it passed validation, then overflowed the builder's int32 stop ids."""
    request = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"min_new_tokens": 1, "stop_token_ids": [2147483648]},
    }
    with pytest.raises(InvalidRequest, match=r"sampling_params\.stop_token_ids: .*2147483648"):
        engine.add_request(**request)
    for ids in ([V], [-1], [3, 2**63]):  # outside the vocabulary, negative: refused with or without
        for sp in ({"stop_token_ids": ids}, {"stop_token_ids": ids, "min_new_tokens": 1}):
            with pytest.raises(InvalidRequest, match=r"sampling_params\.stop_token_ids"):
                engine.add_request(input_ids=[5, 6, 7], sampling_params=sp)
    assert not engine.requests and not engine.has_unfinished()
    # What the step would have met: the builder names the field of the row it cannot pack.
    req = Req(rid="x", input_ids=[5, 6, 7], sampling=SamplingParams(min_new_tokens=1))
    object.__setattr__(req.sampling, "stop_token_ids", (2147483648,))
    with pytest.raises(RowFailed, match=r"sampling_params\.stop_token_ids.*OverflowError") as e:
        BatchBuilder(
            page_size=4, groups=(), max_running=4, max_prefill=16, max_pages=4, vocab_size=V
        ).build(StepPlan([WorkItem(req, 0, 3)]))
    assert e.value.req is req


def test_values_float32_cannot_hold_are_refused(engine):
    """Finding 6: ``top_p`` 1e-300 was 0 on the device (every token dropped: output ids all
    0); ``temperature`` 1e308 was inf (random text)."""
    for sp, field in [
        ({"top_p": 1e-300}, "top_p"),
        ({"top_p": 5e-324}, "top_p"),
        ({"top_p": FLOAT32_TINY / 2}, "top_p"),
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": 3.5e38}, "temperature"),
        ({"min_p": 1e-300, "frequency_penalty": 1e308}, "frequency_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ]:
        with pytest.raises(InvalidRequest, match=rf"sampling_params\.{field}: "):
            engine.add_request(input_ids=[5, 6, 7], sampling_params=sp)
    assert not engine.requests


def test_the_float32_boundaries_that_pass_mean_what_they_say(engine):
    """The extremes still accepted hold in float32 and behave as their definitions: the
    smallest ``top_p`` keeps only the most likely token (the greedy run's tokens), the
    largest ``temperature`` is finite: a draw from the flat distribution, not a NaN row."""
    assert float32(FLOAT32_TINY) == FLOAT32_TINY > 0 and math.isfinite(float32(FLOAT32_MAX))
    prompt = [9, 8, 7, 6, 5, 4]
    greedy = run_alone(
        engine, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    )
    tiny_p = run_alone(
        engine,
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "top_p": FLOAT32_TINY, "seed": 1}},
    )
    assert tiny_p["output_ids"] == greedy["output_ids"]
    hot = run_alone(
        engine,
        {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": FLOAT32_MAX,
                "seed": 1,
                "ignore_eos": True,
            },
            "return_logprob": True,
        },
    )
    # logits / 3.4e38 are all but 0: the draw of a flat distribution with the row's key
    # (``sampler.row_keys``), a NaN row would draw V - 1 every time.
    flat = [
        int(jax.random.categorical(jax.random.fold_in(jax.random.PRNGKey(1), n), jnp.zeros(V)))
        for n in range(6)
    ]
    assert hot["output_ids"] == flat
    assert all(math.isfinite(lp) for lp, _, _ in hot["meta_info"]["output_token_logprobs"])
