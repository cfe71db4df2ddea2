"""Per-request sampling settings, with SGLang's field names.

Invariant: a ``SamplingParams`` that exists holds only values an engine step can hold
(``runtime/batch_builder.py`` packs them into fixed-width arrays; ``runtime/sampler.py`` and
``runtime/penalties.py`` compute with them in float32) and the output formatter can use:

- integers that fit the int32 they are packed into: ``top_k`` (-1, or 1 to 2**31 - 1),
  ``max_new_tokens`` and ``min_new_tokens`` (0 to 2**31 - 1), each of ``stop_token_ids``
  (0 to 2**31 - 1);
- ``seed`` as the sampler's uint32 key (taken modulo 2**32);
- floats whose float32 value is finite and inside the field's range: where the range is
  open at 0 it stays away from 0 on the device: ``top_p`` at least float32's smallest
  normal number (neither rounding nor a device that flushes subnormals to zero makes it 0,
  which keeps no token), ``repetition_penalty`` at least ``MIN_REPETITION_PENALTY`` (a
  logit divided by it stays finite);
- real bools.

A bad value is an ``InvalidRequest`` naming the field, never an overflow inside an engine
step. What depends on the model (stop ids inside its vocabulary, how many stop tokens
``min_new_tokens`` can hold back, prompt + ``max_new_tokens`` inside the context) is checked
when the request is added (``engine/validation.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct

MAX_TOP_LOGPROBS = 20
INT32_MAX = 2**31 - 1
MAX_TOP_K = INT32_MAX  # packed as int32; anything above the vocabulary means "off" anyway
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 2.0**-126  # float32's smallest normal number (TPUs flush smaller ones to 0)
# A seen token's positive logit is divided by the repetition penalty: already a million-fold
# at this floor; far below it the float32 quotient overflows to inf (a logit of 10 / 1e-38),
# and a sampled row's draw becomes NaN.
MIN_REPETITION_PENALTY = 1e-6
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
SEED_RANGE = (-(2**63), 2**64)  # int64 or uint64, as clients send them; used modulo 2**32


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the field."""

    status = 400  # the HTTP status it maps to


class QueueFull(InvalidRequest):
    """The waiting queue is at its bound; the request may be sent again later."""

    status = 503


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
    # Penalties and min_new_tokens (definitions: ``runtime/penalties.py``).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    # Structured output (SGLang's names; ``hicache_jax/grammar``): at most one is set.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        def bad(field, why):
            raise InvalidRequest(f"sampling_params.{field}: {why} (got {show(getattr(self, field))})")

        if not isinstance(self.stop, tuple):
            bad("stop", "must be a tuple of strings")
        if not isinstance(self.stop_token_ids, tuple):
            bad("stop_token_ids", "must be a tuple of integers")

        for f in ("max_new_tokens", "top_k", "n", "min_new_tokens"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(f, f"must be an integer, not {type(v).__name__}")
        for f in ("temperature", "top_p", "min_p", *PENALTIES):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not _finite(v):
                bad(f, "must be a finite number")
            if not math.isfinite(float32(v)):  # e.g. 1e308: the step would hold inf
                bad(f, f"must be a finite float32 number (magnitude at most {FLOAT32_MAX:.8g})")
        for f in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be true or false")
        if not 0 <= self.max_new_tokens <= INT32_MAX:
            bad("max_new_tokens", f"must be in [0, {INT32_MAX}]")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if float32(self.top_p) < FLOAT32_TINY:  # e.g. 1e-300: 0 on the device, which keeps no token
            bad("top_p", f"must be at least {FLOAT32_TINY:.8g} (float32's smallest normal number)")
        if self.top_k == 0 or self.top_k < -1 or self.top_k > MAX_TOP_K:
            bad("top_k", f"must be -1 (off) or in [1, {MAX_TOP_K}]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for f in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, f) <= 2:
                bad(f, "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", "must be in (0, 2]")
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be at least {MIN_REPETITION_PENALTY:g}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"must be in [0, max_new_tokens={self.max_new_tokens}]")
        if self.n != 1:
            bad("n", "only n=1 is supported; send the prompt several times")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                bad("seed", "must be an integer")
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                bad("seed", "must fit in 64 bits")
            object.__setattr__(self, "seed", self.seed % 2**32)  # the sampler's uint32 key
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers")
        out_of_range = [t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX]
        if out_of_range:  # packed as int32 (``min_new_tokens`` holds them back on the device)
            raise InvalidRequest(
                f"sampling_params.stop_token_ids: token ids {show(out_of_range[:5])} outside [0, {INT32_MAX}]"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        grammars = [f for f in GRAMMARS if getattr(self, f) is not None]
        for f in grammars:
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                bad(f, "must be a non-empty string")
        if len(grammars) > 1:
            raise InvalidRequest(f"sampling_params: {' and '.join(grammars)} are both set; send at most one")
        if grammars and self.min_new_tokens:
            bad(
                "min_new_tokens",
                f"is not supported with {grammars[0]} (the grammar decides when the output ends)",
            )

    @property
    def penalised(self) -> bool:
        """Whether the request needs penalty counts on the device (``min_new_tokens``
        alone does not: the batch builder knows how many tokens it has)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output."""
        return any(getattr(self, f) is not None for f in GRAMMARS)

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
            if not isinstance(stop, (str, list, tuple)):
                why = "must be a string or a list of strings"
                raise InvalidRequest(f"sampling_params.stop: {why} (got {show(stop)})")
            d["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        ids = d.get("stop_token_ids")
        if ids is not None:
            if not isinstance(ids, (list, tuple)):
                why = "must be a list of integers"
                raise InvalidRequest(f"sampling_params.stop_token_ids: {why} (got {show(ids)})")
            d["stop_token_ids"] = tuple(ids)
        for f in ("json_schema", "structural_tag"):  # SGLang takes them as JSON text; objects too
            if isinstance(d.get(f), dict):
                d[f] = json.dumps(d[f])
        d = {k: v for k, v in d.items() if v is not None or k == "seed"}
        try:
            return cls(**d)
        except TypeError as e:
            raise InvalidRequest(f"sampling_params: {e}") from e


def float32(v: int | float) -> float:
    """``v`` rounded to float32 as the step holds it (round to nearest; inf past the largest
    finite float32). ``v`` must be finite."""
    try:
        return struct.unpack("f", struct.pack("f", float(v)))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(float(v))  # float(10**400) raises OverflowError
    except OverflowError:
        return False


def show(value, limit: int = 80) -> str:
    """``repr`` for an error message: cut to ``limit`` characters, and safe for integers too
    long for ``repr`` (Python refuses to print ints of more than 4300 digits)."""
    try:
        text = repr(value)
    except ValueError:
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
