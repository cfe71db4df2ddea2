"""The rest of ``EngineAPI`` for the fake engines that drive the engine loop in tests: one
process, no cache to flush, no L3, nothing to recover. A fake subclasses ``FakeEngine`` and
scripts the calls its test is about (``add_request``, ``step``, ``abort``, ...)."""

from __future__ import annotations

from hicache_jax.config import EngineConfig
from hicache_jax.engine.flush_result import FlushResult
from hicache_jax.metric_kinds import Metrics


class FakeEngine:
    cfg = EngineConfig()
    tokenizer = None  # a fake that streams sets a real one
    broken: BaseException | None = None

    def __init__(self) -> None:
        self.requests: dict = {}
        self.stats = {"generated_tokens": 0}

    def compile_grammar(self, sampling_params) -> None:
        pass  # nothing to compile for: a fake samples no tokens under a grammar

    def add_request(self, *args, **kwargs) -> str:
        raise NotImplementedError("not scripted")

    def abort(self, rid: str) -> bool:
        raise NotImplementedError("not scripted")

    def pop_output(self, rid: str, stream=None) -> dict:
        raise NotImplementedError("not scripted")

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> list:
        return []

    def recover(self) -> None:
        self.broken = None

    def flush_cache(self) -> FlushResult:
        return FlushResult(True, "nothing cached")

    def clear_storage(self, all_namespaces: bool = False) -> bool:
        return False

    def metrics(self) -> Metrics:
        return Metrics()

    def heartbeat(self) -> None:
        pass

    def close(self) -> None:
        pass
