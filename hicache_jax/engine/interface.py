"""``EngineAPI``: the engine as the server's engine thread (``server/engine_loop.py``) calls it.

``Engine`` satisfies it, and so does ``multihost/replicated.py``'s ``LeaderEngine``, which
forwards each call to process 0's engine and records the calls that change state for the
other processes. The loop calls every member directly: an engine that lacks one is a bug
found at the first call, not a feature silently skipped.

Every call but ``compile_grammar`` comes from one thread (the engine thread); nothing else
here is thread-safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from hicache_jax.config import EngineConfig
    from hicache_jax.engine.flush_result import FlushResult
    from hicache_jax.engine.outputs import OutputDelta, OutputStream
    from hicache_jax.metric_kinds import Metrics
    from hicache_jax.models.tokenizer import Tokenizer
    from hicache_jax.request import Req


@runtime_checkable
class EngineAPI(Protocol):
    cfg: EngineConfig
    tokenizer: Tokenizer
    requests: dict[str, Req]  # by rid: queued, running, and finished until ``pop_output``
    stats: Metrics  # counters; the loop reads ``generated_tokens`` (its throughput gauge)
    broken: BaseException | None  # a failed step's cause, until ``recover()`` rebuilds

    def compile_grammar(self, sampling_params) -> None:
        """Compile the grammar of a request's sampling params (``SamplingParams`` or their
        dict), if it has one, before its ``add_request``. Thread-safe: the server calls it on
        a worker thread, so the engine thread finds the grammar compiled and no step waits."""
        ...

    def add_request(self, *args, **kwargs) -> str:
        """Validate and queue one request (``Engine.add_request``'s fields); returns its rid.
        Raises ``InvalidRequest`` (``QueueFull`` when the queue is full)."""
        ...

    def abort(self, rid: str) -> bool:
        """Finish a queued or running request as aborted; False if it is not live."""
        ...

    def pop_output(self, rid: str, stream: OutputStream | None = None) -> dict | OutputDelta:
        """A finished request's output (with its ``stream``: only the last delta); the rid
        is free again afterwards."""
        ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[Req]:
        """Run one batch; the requests that finished or produced tokens. Raises
        ``StepFailed`` (the engine failed its running requests and rebuilt itself, or is
        ``broken`` until ``recover``), ``EngineLost`` (several processes disagree)."""
        ...

    def recover(self) -> None:
        """Rebuild device state after a failed step; raises if it cannot yet."""
        ...

    def flush_cache(self) -> FlushResult:
        """Clear L1 and L2, keep L3; ``success`` is False while requests are in flight."""
        ...

    def clear_storage(self, all_namespaces: bool = False) -> bool:
        """Delete this server's L3 pages (its namespace, every cache_salt tenant), or with
        ``all_namespaces`` every model's; only keys this project wrote. False when no L3 is
        configured."""
        ...

    def metrics(self) -> Metrics: ...

    def heartbeat(self) -> None:
        """Called while idle: over several processes the others hear from process 0."""
        ...

    def close(self) -> None:
        """Stop background work (L3 writes get their deadline); the last call."""
        ...
