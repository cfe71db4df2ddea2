"""One engine on several processes: process 0 decides, the others replay its calls.

Process 0 serves HTTP and drives a ``LeaderEngine``: a proxy that passes every call to its
engine and records each call that changes the engine's state (``add_request``, ``abort``,
``pop_output``, ``step``, ``flush_cache``, ...). Before a call that runs on the device it
broadcasts the calls recorded since the last one, that call included, to every other
process, whose ``follow`` loop replays them in the same order on its own engine::

    process 0   add add abort | step ........ | add | step ....
    process i   ...... replay: add add abort step | replay: add step ....

Why replay the calls rather than broadcast each step's plan: every process keeps its own
radix tree, pools and request states, which the plans alone would not keep in step; the
calls are also far smaller than the plans. The same calls in the same order give the same
decisions on every process: admission, chunk ends, eviction, retraction, and sampling seeds
(the engine draws them from its seeded generator); request ids are drawn on process 0 and
recorded with the call. A drift (a bug, or a decision read from a clock) is caught before
launch by the per-step plan digest (``distributed.check_same_plan``): every process raises
``PlanDivergence`` and stops, rather than hang in collectives that never meet.

What only process 0 can know travels with its calls as data: the L3 prefetch. Process 0
alone reads L3 for prefetches; before each ``step`` it decides what landed and which requests
still wait (``Scheduler.prefetch_decisions``, from ``scheduler/l3_prefetch.py``: a clock and
I/O, different on every host), and that decision, the landed pages included, is the recorded
step's argument. So every process puts the same pages in its L2 and admits the same requests.
L2 holds whole pages on every process (``runtime/transfer.py``), and each process writes its
own share of them to L3 (``StorageTier.writer``), so no page is written twice.

While process 0 is idle, the others wait in the broadcast; the engine loop calls
``heartbeat`` while idle, so they hear from it (an empty call list) at least every
``HEARTBEAT_S`` and never sit in one collective for long. When process 0 closes its engine
(the server stops), ``close`` reaches the others and ``follow`` returns. After a divergence,
or when the others cannot be reached, ``EngineLost`` is raised and nothing more is sent.
"""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from typing import TYPE_CHECKING

import numpy as np

from hicache_jax.engine.failures import EngineLost, StepFailed

if TYPE_CHECKING:
    from hicache_jax.config import EngineConfig
    from hicache_jax.engine.engine import Engine
    from hicache_jax.engine.flush_result import FlushResult
    from hicache_jax.engine.outputs import OutputDelta
    from hicache_jax.metric_kinds import Metrics
    from hicache_jax.models.tokenizer import Tokenizer
    from hicache_jax.request import Req

log = logging.getLogger(__name__)

DEVICE_CALLS = frozenset({"step", "sync", "flush_cache", "clear_storage", "recover", "close"})
STATE_CALLS = frozenset({"add_request", "abort", "pop_output"})
HEARTBEAT_S = 2.0  # while process 0 is idle, the others hear from it at least this often


class LeaderEngine:
    """Process 0's engine, recording its state-changing calls for the other processes. It
    satisfies ``EngineAPI`` (``engine/interface.py``), so the server's engine thread drives it
    as it drives a plain ``Engine``."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._calls: list[tuple[str, tuple, dict]] = []
        self._sent = time.monotonic()
        self.lost: EngineLost | None = None  # set once: nothing is sent after it

    def heartbeat(self) -> None:
        """Called while idle: send what is recorded (maybe nothing) if the others have not
        heard from this process for ``HEARTBEAT_S``."""
        if self.lost is None and time.monotonic() - self._sent >= HEARTBEAT_S:
            self._send()

    # -- reads: this process's engine, unrecorded ---------------------------------------------
    @property
    def cfg(self) -> EngineConfig:
        return self._engine.cfg

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def requests(self) -> dict[str, Req]:
        return self._engine.requests

    @property
    def stats(self) -> Metrics:
        return self._engine.stats

    @property
    def broken(self) -> BaseException | None:
        return self._engine.broken

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished()

    def metrics(self) -> Metrics:
        return self._engine.metrics()

    def compile_grammar(self, sampling_params) -> None:
        """Into this process's grammar cache only: the others compile a grammar when they
        replay the ``add_request`` that needs it."""
        self._engine.compile_grammar(sampling_params)

    def __getattr__(self, name: str):
        """Start-up facts outside ``EngineAPI`` (``model``, ``context_len``, ``runner``: read by
        ``ServerState.from_engine``)."""
        return getattr(self._engine, name)

    # -- STATE_CALLS: run here, recorded, sent with the next device call -----------------------
    def add_request(self, *args, **kwargs) -> str:
        if not kwargs.get("rid"):
            kwargs["rid"] = uuid.uuid4().hex  # drawn here, replayed as given
        return self._state_call("add_request", self._engine.add_request, args, kwargs)

    def abort(self, *args, **kwargs) -> bool:
        return self._state_call("abort", self._engine.abort, args, kwargs)

    def pop_output(self, *args, **kwargs) -> dict | OutputDelta:
        return self._state_call("pop_output", self._engine.pop_output, args, kwargs)

    # -- DEVICE_CALLS: sent with what is recorded, then run here -------------------------------
    def step(self, prefetch=None):
        """A step, with what the L3 prefetch brought as decided here: only process 0 reads
        L3, so its decision is the step's argument everywhere."""
        if prefetch is None and self.lost is None:
            prefetch = self._engine.prefetch_decisions()
        return self._device_call("step", self._engine.step, (), {"prefetch": prefetch})

    def sync(self, *args, **kwargs):
        return self._device_call("sync", self._engine.sync, args, kwargs)

    def flush_cache(self, *args, **kwargs) -> FlushResult:
        return self._device_call("flush_cache", self._engine.flush_cache, args, kwargs)

    def clear_storage(self, all_namespaces: bool = False) -> bool:
        return self._device_call(
            "clear_storage", self._engine.clear_storage, (), {"all_namespaces": all_namespaces}
        )

    def recover(self, *args, **kwargs) -> None:
        return self._device_call("recover", self._engine.recover, args, kwargs)

    def close(self) -> None:
        """Close every process's engine, then leave ``jax.distributed`` together; after
        ``lost``, only this process's own (its L3 work still stops)."""
        if self.lost is not None:
            return self._engine.close()
        self._calls.append(("close", (), {}))
        self._send()
        self._engine.close()
        leave()  # every process meets here, then the coordinator may go

    def _state_call(self, name: str, call, args: tuple, kwargs: dict):
        result = call(*args, **kwargs)  # a refused call raises here and is not recorded
        # A stream only shapes what process 0 returns; elsewhere the request is dropped.
        self._calls.append((name, args[:1], {}) if name == "pop_output" else (name, args, kwargs))
        return result

    def _device_call(self, name: str, call, args: tuple, kwargs: dict):
        """Send what is recorded and this call to the others, then run it here."""
        if self.lost is not None:
            raise self.lost
        self._calls.append((name, args, kwargs))
        self._send()
        try:
            return call(*args, **kwargs)
        except StepFailed as e:
            if isinstance(e.__cause__, EngineLost):
                self.lost = e.__cause__
            raise

    def _send(self) -> None:
        self._sent = time.monotonic()
        try:
            _broadcast(self._calls)
        except Exception as e:  # a process died or the network broke: no step can follow
            self.lost = EngineLost(f"cannot reach the other processes: {type(e).__name__}: {e}")
            raise self.lost from e
        finally:
            self._calls = []


def follow(engine) -> None:
    """Replay process 0's calls on this process's engine until it closes; raises
    ``EngineLost`` (``PlanDivergence``) when the processes disagree."""
    while True:
        for name, args, kwargs in _receive():
            try:
                getattr(engine, name)(*args, **kwargs)
            except EngineLost:
                raise
            except StepFailed as e:
                if isinstance(e.__cause__, EngineLost):
                    raise e.__cause__ from None
                log.warning("replayed %s failed as on process 0: %s", name, e)
            except Exception as e:  # process 0 saw the same failure and answered it
                log.warning("replayed %s failed: %s: %s", name, type(e).__name__, e)
            if name == "close":
                leave()
                return


def leave() -> None:
    """Leave ``jax.distributed`` together (a barrier of every process). A process that
    just exits takes the coordination service (process 0) or its heartbeat away, and the
    others abort."""
    import jax

    if jax.process_count() > 1:
        jax.distributed.shutdown()


def _bucket(n: int) -> int:
    return max(1024, 1 << (n - 1).bit_length())  # a few buffer sizes, a few broadcast programs


def _broadcast(calls: list) -> None:
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(calls), np.uint8)
    multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int32))
    buf = np.zeros(_bucket(len(data)), np.uint8)
    buf[: len(data)] = data
    multihost_utils.broadcast_one_to_all(buf)


def _receive() -> list:
    from jax.experimental import multihost_utils

    n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(1, np.int32)))[0])
    buf = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(_bucket(n), np.uint8)))
    return pickle.loads(buf[:n].tobytes())
