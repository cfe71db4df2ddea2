"""``POST /generate``: SGLang's request fields, checked before anything reaches the engine.

Types are strict (``"5"`` is not an integer) and unknown fields are refused, so a typo like
``max_new_token`` is an error instead of a silently ignored setting. What needs the model
(vocabulary, context length) is checked by ``Engine.add_request``; sampling settings by
``SamplingParams``: the server never duplicates those rules.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from hicache_jax.sampling_params import InvalidRequest, SamplingParams
from hicache_jax.server import choices, compat_fields
from hicache_jax.server.compat_fields import Compat
from hicache_jax.server.errors import ApiError, describe_validation_errors
from hicache_jax.server.rooms import rooms_for

MAX_BATCH = 1024  # prompts per /generate or /v1/completions call
MAX_BODY_BYTES = 64 << 20  # a request body is read into memory: bound it (ServerState narrows it)
M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    compat: ClassVar[tuple[Compat, ...]] = ()  # other APIs' fields, taken as no-ops or refused

    @model_validator(mode="before")
    @classmethod
    def _drop_compat(cls, data: Any) -> Any:
        return compat_fields.drop_compat(data, cls.compat)


async def parse_body(request: Request, model: type[M], optional: bool = False) -> M:
    """The JSON body as ``model``, whatever the Content-Type (``curl -d`` sends form-encoded);
    InvalidRequest with a readable message otherwise. ``optional``: no body is ``model()``."""
    state = getattr(request.app.state, "server", None)
    raw = await read_body(request, MAX_BODY_BYTES if state is None else state.max_body_bytes)
    if not raw.strip() and optional:
        return model()
    if not raw.strip():
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_errors(e.errors())) from None


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, or a 413 as soon as it passes ``limit`` bytes (whatever Content-Length says)."""
    too_big = ApiError(
        413, f"the request body is larger than {limit} bytes, more prompt than this server's queue can hold"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        parts.append(chunk)
    return b"".join(parts)


class ClearStorageRequest(StrictModel):
    """``POST /clear_storage``'s optional body."""

    all_namespaces: bool = False  # every model's pages on the store, not only this server's


class ProfileRequest(StrictModel):
    """``POST /start_profile``'s optional body (SGLang's field names)."""

    output_dir: str | None = None  # default: --profile_dir
    num_steps: int | None = None  # stop by itself after this many engine steps


class GenerateRequest(StrictModel):
    """SGLang's ``GenerateReqInput``: these fields, and ``compat_fields.GENERATE``. Null is
    SGLang's default for the logprob settings."""

    compat = compat_fields.GENERATE
    text: str | list[str] | None = None
    input_ids: Any = None  # list[int] | list[list[int]]: checked in to_engine_requests for a clear message
    sampling_params: Any = None  # dict | list[dict]: SamplingParams checks the fields
    return_logprob: bool | None = False
    logprob_start_len: int | None = -1
    top_logprobs_num: int | None = 0
    stream: bool = False
    rid: str | list[str] | None = None
    cache_salt: str | None = None
    # sglang-router's PD mode (server/disaggregation.py): a room per prompt; host and port
    # name SGLang's bootstrap server, which the L3 handover has no use for.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None

    def prompts(self) -> tuple[list[dict], bool]:
        """[{text} | {input_ids}] and whether the request was a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequest("give exactly one of text or input_ids")
        if self.text is not None:
            batched = isinstance(self.text, list)
            texts = self.text if batched else [self.text]
            for i, t in enumerate(texts):
                if not t:
                    raise InvalidRequest(f"text{f'[{i}]' if batched else ''} is empty")
            return [{"text": t} for t in texts], batched
        ids = self.input_ids
        if not isinstance(ids, list) or not ids:
            raise InvalidRequest("input_ids must be a non-empty list of token ids (or a list of such lists)")
        batched = isinstance(ids[0], list)
        seqs = ids if batched else [ids]
        for i, seq in enumerate(seqs):
            where = f"input_ids[{i}]" if batched else "input_ids"
            if not isinstance(seq, list) or any(not _is_int(t) for t in seq):
                raise InvalidRequest(f"{where} must be a list of integers")
            if not seq:
                raise InvalidRequest(f"{where} is empty")
        return [{"input_ids": s} for s in seqs], batched

    def to_engine_requests(self, max_n: int = 128) -> tuple[list[dict], bool]:
        """``Engine.add_request`` keyword arguments per prompt (each with a rid), and whether
        the response is a list. With ``sampling_params.n`` > 1 that is n per prompt, in
        order (``choices``: rids ``<rid>_<j>``), and always a list, as in SGLang."""
        items, batched = self.prompts()
        n = len(items)
        if n > MAX_BATCH:
            raise InvalidRequest(f"at most {MAX_BATCH} prompts per request, got {n}")
        if self.stream and batched:
            raise InvalidRequest("stream=true takes a single prompt; send one request per prompt")
        params = self.sampling_params
        if isinstance(params, list):
            if len(params) != n:
                raise InvalidRequest(f"{len(params)} sampling_params for {n} prompts")
        else:
            params = [params] * n
        params, n_choices = choices.take_n(params, MAX_BATCH, max_n)
        params = [compat_fields.sglang_sampling_params(p) for p in params]
        for p in params:
            SamplingParams.from_dict(p)  # fail fast, before the engine thread
        rids = self.rid
        if rids is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(rids, str):
            if batched:
                raise InvalidRequest("rid must be a list with one id per prompt for a batch")
            rids = [rids]
        elif len(rids) != n or not batched:
            raise InvalidRequest(f"rid: {len(rids)} ids for {n} prompt(s)")
        if len(set(rids)) != len(rids):
            raise InvalidRequest("rid: ids must be distinct")
        common = dict(
            return_logprob=bool(self.return_logprob),
            logprob_start_len=-1 if self.logprob_start_len is None else self.logprob_start_len,
            top_logprobs_num=self.top_logprobs_num or 0,
            cache_salt=self.cache_salt,
            stream=self.stream,
        )
        rooms = rooms_for(self.bootstrap_room, n)
        reqs = [
            dict(item, sampling_params=p, rid=r, bootstrap_room=room, **common)
            for item, p, r, room in zip(items, params, rids, rooms)
        ]
        return choices.expand(reqs, n_choices), batched or n_choices > 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
