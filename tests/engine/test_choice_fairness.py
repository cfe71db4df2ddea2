"""Issue 39, finding 7: one request's n choices held the engine while another client's
request waited behind them all (FCFS). Through the server's own expansion of ``n``
(``server/choices.py``) and a real engine: a lone request sent after a 16-choice request
ends while most choices are still to come; with the share off (the control) it ends only
after most of them."""

from __future__ import annotations

import pytest

from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.scheduler import scheduler
from hicache_jax.server import choices

N = 16


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(preset="tiny", chunked_prefill_size=64, max_running_requests=4, max_total_tokens=2048)
    return Engine(cfg)


def choices_done_when_lone_ends(engine: Engine, prompt: list[int]) -> int:
    """How many of the group's choices had ended when the lone request (sent once the group
    runs) ended."""
    big = {"rid": f"big{prompt[0]}", "input_ids": prompt, "sampling_params": {"max_new_tokens": 12}}
    group = choices.expand([big], N)
    for r in group:
        engine.add_request(**r)
    lone = None
    ended = 0
    while engine.has_unfinished():
        engine.step()
        if lone is None and len(engine.scheduler.running) == 4:
            lone = engine.add_request(input_ids=[9, 8, 7], sampling_params={"max_new_tokens": 4})
        if lone is not None and engine.requests[lone].finished and not ended:
            ended = sum(engine.requests[r["rid"]].finished for r in group)
    for rid in [r["rid"] for r in group] + [lone]:
        engine.pop_output(rid)
    return ended


def test_a_lone_request_is_not_starved_by_many_choices(engine, monkeypatch):
    fair = choices_done_when_lone_ends(engine, [5, 6, 7, 8])
    monkeypatch.setattr(scheduler, "GROUP_SHARE", 1.0)  # the control: FCFS, no share
    unfair = choices_done_when_lone_ends(engine, [15, 16, 17, 18])
    assert fair <= 4 < N // 2 <= unfair, (fair, unfair)
