"""The call protocol of ``hicache_jax/multihost/replicated.py`` in one process, the broadcast replaced
by a list: what process 0 sends, when, and how a follower replays it. Two real processes
behind the server binary: ``tests/server/test_multihost.py``."""

from __future__ import annotations

import pytest

from hicache_jax.engine.failures import EngineLost, StepFailed
from hicache_jax.multihost import replicated
from hicache_jax.multihost.distributed import PlanDivergence
from hicache_jax.multihost.replicated import HEARTBEAT_S, LeaderEngine, follow


class RecordingEngine:
    """Records the calls made on it; ``step`` fails as told."""

    def __init__(self, fail_with: BaseException | None = None):
        self.calls: list[tuple] = []
        self.fail_with = fail_with

    def prefetch_decisions(self):
        return f"decided before step {sum(c[0] == 'step' for c in self.calls)}"

    def add_request(self, input_ids=None, sampling_params=None, *, rid=None):
        self.calls.append(("add_request", rid))
        return rid

    def step(self, prefetch=None):
        self.calls.append(("step", prefetch))
        if self.fail_with is not None:
            raise StepFailed([], "step failed") from self.fail_with
        return []

    def pop_output(self, rid, stream=None):
        self.calls.append(("pop_output", rid))
        return {"rid": rid}

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def sent(monkeypatch):
    out: list[list] = []
    monkeypatch.setattr(replicated, "_broadcast", lambda calls: out.append(list(calls)))
    return out


def test_state_calls_travel_with_the_next_device_call_and_steps_carry_process_0s_prefetch(sent):
    engine = RecordingEngine()
    leader = LeaderEngine(engine)
    rid = leader.add_request(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert rid and not sent, "a state call waits for the next device call"
    leader.step()
    leader.pop_output(rid, stream="a stream object")
    leader.close()
    (first, second) = sent
    assert [c[0] for c in first] == ["add_request", "step"]
    assert first[0][2]["rid"] == rid, "the rid drawn on process 0 is replayed as given"
    assert first[1][2] == {"prefetch": "decided before step 0"}
    assert second == [("pop_output", (rid,), {}), ("close", (), {})], "a stream stays on process 0"


def test_heartbeat_while_idle(sent, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(replicated.time, "monotonic", lambda: now[0])
    leader = LeaderEngine(RecordingEngine())
    leader.heartbeat()
    assert not sent, "heard from just now"
    now[0] += HEARTBEAT_S
    leader.add_request(input_ids=[3], sampling_params={})
    leader.heartbeat()
    assert len(sent) == 1 and [c[0] for c in sent[0]] == ["add_request"]
    now[0] += HEARTBEAT_S / 2
    leader.heartbeat()
    assert len(sent) == 1
    now[0] += HEARTBEAT_S
    leader.heartbeat()
    assert sent[1] == [], "an empty call list: only that process 0 is alive"


def test_a_divergence_is_final_on_process_0(sent):
    leader = LeaderEngine(RecordingEngine(fail_with=PlanDivergence("step 3: differs")))
    with pytest.raises(StepFailed):
        leader.step()
    assert isinstance(leader.lost, PlanDivergence)
    with pytest.raises(PlanDivergence):
        leader.step()
    leader.heartbeat()
    leader.close()  # this process's own close still runs, and nothing more is sent
    assert len(sent) == 1


def test_an_unreachable_process_is_engine_lost(monkeypatch):
    def broken(calls):
        raise RuntimeError("gloo: connection reset by peer")

    monkeypatch.setattr(replicated, "_broadcast", broken)
    leader = LeaderEngine(RecordingEngine())
    with pytest.raises(EngineLost, match="cannot reach the other processes: RuntimeError: gloo"):
        leader.step()
    assert leader.lost is not None


def test_follow_replays_in_order_skips_heartbeats_and_stops_on_close(monkeypatch):
    work = [("add_request", (), {"rid": "r"}), ("step", (), {"prefetch": "p"})]
    batches = iter([[], work, [], [("close", (), {})]])
    monkeypatch.setattr(replicated, "_receive", lambda: next(batches))
    engine = RecordingEngine()
    follow(engine)
    assert engine.calls == [("add_request", "r"), ("step", "p"), ("close",)]


def test_follow_raises_on_a_divergence_and_goes_on_after_an_ordinary_failure(monkeypatch):
    batches = iter([[("step", (), {"prefetch": None})], [("close", (), {})]])
    monkeypatch.setattr(replicated, "_receive", lambda: next(batches))
    follow(RecordingEngine(fail_with=RuntimeError("device error, as on process 0")))
    batches = iter([[("step", (), {"prefetch": None})]])
    with pytest.raises(PlanDivergence):
        follow(RecordingEngine(fail_with=PlanDivergence("step 1: differs")))
