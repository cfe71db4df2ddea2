"""Per-request sampling settings, with SGLang's field names."""

from __future__ import annotations

import dataclasses

MAX_TOP_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the field."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self):
        def bad(field, why):
            raise InvalidRequest(f"sampling_params.{field}: {why} (got {getattr(self, field)!r})")

        for f in ("max_new_tokens", "top_k", "n"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(f, f"must be an integer, not {type(v).__name__}")
        for f in ("temperature", "top_p", "min_p"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                bad(f, "must be a number")
        if self.max_new_tokens < 0:
            bad("max_new_tokens", "must be >= 0")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", "must be -1 (off) or >= 1")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.n != 1:
            bad("n", "only n=1 is supported; send the prompt several times")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict | SamplingParams | None) -> SamplingParams:
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        if not isinstance(d, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(d).__name__}")
        d = dict(d)
        if "sampling_seed" in d:  # SGLang's name
            d["seed"] = d.pop("sampling_seed")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequest(f"sampling_params: unknown field(s) {unknown}; known: {sorted(known)}")
        stop = d.get("stop")
        if stop is not None:
            d["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        if d.get("stop_token_ids") is not None:
            d["stop_token_ids"] = tuple(d["stop_token_ids"])
        d = {k: v for k, v in d.items() if v is not None or k == "seed"}
        try:
            return cls(**d)
        except TypeError as e:
            raise InvalidRequest(f"sampling_params: {e}") from e
