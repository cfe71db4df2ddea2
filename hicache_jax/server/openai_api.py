"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``
(and ``/v1/models/{id}``).

Both generation routes turn the body into engine requests, queue them through the engine
loop, and answer either once (JSON) or as Server-Sent Events in OpenAI's chunk format,
ending with ``data: [DONE]``. Cached prompt tokens are reported in
``usage.prompt_tokens_details.cached_tokens`` (per tier in ``cached_tokens_details``).
``stream_options.include_usage`` adds a last chunk with the usage; vLLM's
``continuous_usage_stats`` puts the usage so far in every chunk.

``echo: true`` on ``/v1/completions`` (not streamed) puts the prompt before the completion,
in ``text`` and, with ``logprobs``, in the legacy logprobs lists: the prompt's tokens
(scored from position 0, so the first one's logprob is ``null``), then the generated ones.
lm-eval's ``local-completions`` scores choices this way, with ``max_tokens`` 1.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from hicache_jax.sampling_params import show
from hicache_jax.server import choices, tool_choice
from hicache_jax.server.errors import ApiError, error_response
from hicache_jax.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from hicache_jax.server.prompt_size import check_text, tokenize_texts, utf8_len
from hicache_jax.server.protocol import MAX_BATCH, parse_body
from hicache_jax.server.rooms import rooms_for
from hicache_jax.server.state import ServerState
from hicache_jax.server.streaming import Watch, sse, stream_response, wait_whole
from hicache_jax.tiers import TIERS

router = APIRouter()


Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _accept(request: Request, protocol: type[Body]) -> tuple[Body, ServerState]:
    """The parsed body and the server's state, once the body names the served model and asks
    only for what the server supports."""
    body = await parse_body(request, protocol)
    s = _state(request)
    if body.model != s.served_model_name:
        raise ApiError(404, f"model {show(body.model)} not found; this server serves {s.served_model_name!r}")
    body.check_supported(s.server_cfg.max_n)
    return body, s


# ---- response pieces -----------------------------------------------------------------------------
def finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason.get("type")


def usage(metas: list[dict], n: int = 1) -> dict:
    """The usage of these outputs, ``n`` choices per prompt (prompt-major): each prompt counts
    once, with its first choice's prompt and cached tokens (as OpenAI and vLLM count); every
    choice's completion counts."""
    prompts = metas[::n]
    prompt = sum(m["prompt_tokens"] for m in prompts)
    completion = sum(m["completion_tokens"] for m in metas)
    details = {t: sum(m["cached_tokens_details"].get(t, 0) for m in prompts) for t in TIERS}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(m["cached_tokens"] for m in prompts),
            "cached_tokens_details": details,
        },
    }


def _token(triple) -> str:
    return triple[2] if triple[2] is not None else f"<{triple[1]}>"


def _logprobs(meta: dict) -> tuple[list, list | None]:
    """A whole output's logprob triples and top logprobs."""
    return meta.get("output_token_logprobs", []), meta.get("output_top_logprobs")


def completion_logprobs(triples: list, tops: list | None, offset: int) -> dict:
    """Legacy completions format for these output tokens, text offsets from ``offset``."""
    tops = tops if tops is not None else [None] * len(triples)
    tokens = [_token(t) for t in triples]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [t[0] for t in triples],
        "top_logprobs": [_top_dict(top) if top else None for top in tops],
        "text_offset": offsets,
    }


def _top_dict(top: list) -> dict:
    """{token text: logprob}; tokens with the same text (byte pieces of one character all read
    U+FFFD) keep the highest logprob, so ``max(values)`` is still the top token's."""
    out: dict = {}
    for x in top:  # highest first
        out.setdefault(_token(x), x[0])
    return out


def echo_logprobs(meta: dict, prompt_text: str) -> dict:
    """Legacy completions format for the prompt's tokens, then the generated ones (whose
    text offsets start after ``prompt_text``)."""
    head = completion_logprobs(meta.get("input_token_logprobs", []), meta.get("input_top_logprobs"), 0)
    tail = completion_logprobs(*_logprobs(meta), len(prompt_text))
    return {k: head[k] + tail[k] for k in head}


def prompt_text(prompt: dict, tokenizer) -> str:
    """The text of one prompt (``text`` or ``input_ids``) as echoed: ids are decoded, special
    tokens kept; a model without a tokenizer echoes ids as ``""``."""
    if "text" in prompt:
        return prompt["text"]
    return tokenizer.decode(prompt["input_ids"], skip_special_tokens=False) or ""


def chat_logprobs(triples: list, tops: list | None) -> dict:
    tops = tops if tops is not None else [None] * len(triples)

    def entry(t):
        tok = _token(t)
        return {"token": tok, "logprob": t[0], "bytes": list(tok.encode())}

    return {
        "content": [
            dict(entry(t), top_logprobs=[entry(x) for x in (top or [])]) for t, top in zip(triples, tops)
        ]
    }


# ---- routes ------------------------------------------------------------------------------------
def _card(s: ServerState) -> dict:
    return {
        "id": s.served_model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "hicache-jax",
        "root": s.served_model_name,
        "max_model_len": s.context_len,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_card(_state(request))]}


@router.get("/v1/models/{model_id:path}")  # a served name may hold a slash (org/name)
async def model(request: Request, model_id: str) -> dict:
    s = _state(request)
    if model_id != s.served_model_name:
        raise ApiError(404, f"model {show(model_id)} not found; this server serves {s.served_model_name!r}")
    return _card(s)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body, s = await _accept(request, CompletionRequest)
    prompts = body.prompts()
    if body.stream and len(prompts) > 1:
        raise ApiError(400, "stream=true takes a single prompt; send one request per prompt")
    n = choices.check_n(body.n, len(prompts), MAX_BATCH, s.server_cfg.max_n)
    want_lp = body.logprobs is not None
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    lsl = 0 if body.echo else -1  # echo: the prompt's logprobs from its first token
    rooms = rooms_for(body.bootstrap_room, len(prompts))
    reqs = [
        dict(_engine_request(p, "cmpl", body, max_tokens, want_lp, body.logprobs, lsl), bootstrap_room=room)
        for p, room in zip(prompts, rooms)
    ]
    await tokenize_texts(reqs, s.chat.tokenizer, s.max_text_bytes)
    rid = reqs[0]["rid"]
    reqs = choices.expand(reqs, n)  # choice k: prompt k // n
    created = int(time.time())

    def choice(i: int, text: str, logprobs: tuple, offset: int, reason: str | None) -> dict:
        return {
            "index": i,
            "text": text,
            "logprobs": completion_logprobs(*logprobs, offset) if want_lp else None,
            "finish_reason": reason,
        }

    def frame(cs: list, **extra) -> dict:
        return dict(
            id=rid,
            object="text_completion",
            created=created,
            model=s.served_model_name,
            choices=cs,
            **extra,
        )

    async def chunks(watch: Watch) -> AsyncIterator[bytes]:
        sent = [0] * len(reqs)  # characters sent so far, per choice
        finals: list[dict] = [{}] * len(reqs)
        async for i, upd in watch.interleaved():
            delta = upd.out  # what is new since the choice's previous update
            text = delta.text or ""
            if text or upd.finished or (want_lp and delta.output_ids):
                reason = finish_reason(delta.meta) if upd.finished else None
                c = choice(i, text, (delta.logprobs or [], delta.top_logprobs), sent[i], reason)
                yield sse(frame([c], **_running_usage(body, delta.meta)))
            sent[i] += len(text)
            if upd.finished:
                finals[i] = delta.meta
        if body.include_usage:
            yield sse(frame([], usage=usage(finals, n)))

    async def whole(outs: list[dict]) -> dict:
        metas = [o["meta_info"] for o in outs]
        cs = [
            choice(i, o["text"] or "", _logprobs(m), 0, finish_reason(m))
            for i, (o, m) in enumerate(zip(outs, metas))
        ]
        if body.echo:
            for k, (c, m) in enumerate(zip(cs, metas)):
                head = prompt_text(prompts[k // n], s.chat.tokenizer)
                c["text"] = head + c["text"]
                c["logprobs"] = echo_logprobs(m, head) if want_lp else None
        return frame(cs, usage=usage(metas, n))

    return await _respond(s, request, reqs, body.stream, chunks, whole)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body, s = await _accept(request, ChatCompletionRequest)
    tools = tool_choice.plan(body.tools, body.tool_choice, body.parallel_tool_calls, s.tool_format)
    messages = [m.as_template_input(f"messages[{i}]") for i, m in enumerate(body.messages)]
    check_text(sum(utf8_len(m["content"]) for m in messages), s.max_text_bytes, "messages")
    variables = dict(body.chat_template_kwargs or {})
    if body.tools:
        variables["tools"] = body.tools
    ids = await asyncio.to_thread(s.chat.encode, messages, True, variables)
    max_tokens = body.max_new_tokens(len(ids), s.max_request_tokens)
    req = _engine_request({"input_ids": ids}, "chatcmpl", body, max_tokens, body.logprobs, body.top_logprobs)
    (req["bootstrap_room"],) = rooms_for(body.bootstrap_room, 1)
    if tools is not None:
        extra = tools.sampling_params()
        if "json_schema" in extra and body.grammar_params():
            raise ApiError(
                400,
                f"tool_choice={tools.mode!r} and a grammar (response_format, regex, ebnf) both "
                "constrain the output; send one",
            )
        req["sampling_params"].update(extra)
    rid = req["rid"]
    n = body.n or 1
    reqs = choices.expand([req], n)
    created = int(time.time())

    def frame(cs: list, obj: str, **extra) -> dict:
        return dict(id=rid, object=obj, created=created, model=s.served_model_name, choices=cs, **extra)

    def role(i: int) -> dict:  # a choice's first chunk
        return {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    async def chunks(watch: Watch) -> AsyncIterator[bytes]:
        unannounced = set(range(n))
        if not body.continuous_usage:  # else each waits for its choice's first update, to carry its usage
            for i in range(n):
                yield sse(frame([role(i)], "chat.completion.chunk"))
            unannounced.clear()
        finals: list[dict] = [{}] * n
        streams = [tools.stream() if tools is not None else None for _ in range(n)]
        async for i, upd in watch.interleaved():
            delta = upd.out  # what is new since the choice's previous update
            running = _running_usage(body, delta.meta)

            def chunk(c: dict, running=running) -> bytes:
                return sse(frame([c], "chat.completion.chunk", **running))

            if i in unannounced:
                yield chunk(role(i))
                unannounced.discard(i)
            text = delta.text or ""
            pieces = [{"content": text}] if text else []
            if streams[i] is not None:
                pieces = streams[i].feed(text) + (streams[i].close() if upd.finished else [])
            lp = chat_logprobs(delta.logprobs or [], delta.top_logprobs) if body.logprobs else None
            if not pieces and (upd.finished or (body.logprobs and delta.output_ids)):
                pieces = [{}]
            for k, piece in enumerate(pieces):
                last = upd.finished and k == len(pieces) - 1
                reason = finish_reason(delta.meta) if last else None
                if last and streams[i] is not None:
                    reason = tools.finish_reason(reason, streams[i].calls > 0)
                c = {"index": i, "delta": piece, "logprobs": lp if k == 0 else None, "finish_reason": reason}
                yield chunk(c)
            if upd.finished:
                finals[i] = delta.meta
        if body.include_usage:
            yield sse(frame([], "chat.completion.chunk", usage=usage(finals, n)))

    def message(out: dict) -> tuple[dict, str | None]:
        reason = finish_reason(out["meta_info"])
        content = out["text"] or ""
        if tools is None:
            return {"role": "assistant", "content": content}, reason
        content, calls = tools.split(content)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg, tools.finish_reason(reason, bool(calls))

    async def whole(outs: list[dict]) -> dict:
        cs = []
        for i, out in enumerate(outs):
            msg, reason = message(out)
            cs.append(
                {
                    "index": i,
                    "message": msg,
                    "logprobs": chat_logprobs(*_logprobs(out["meta_info"])) if body.logprobs else None,
                    "finish_reason": reason,
                }
            )
        return frame(cs, "chat.completion", usage=usage([o["meta_info"] for o in outs], n))

    return await _respond(s, request, reqs, body.stream, chunks, whole)


def _running_usage(body, meta: dict) -> dict:
    """``{"usage": ...}`` so far for a chunk under ``continuous_usage_stats``, else nothing."""
    return {"usage": usage([meta])} if body.continuous_usage else {}


def _engine_request(
    prompt: dict, kind: str, body, max_tokens: int, logprobs: bool, top: int | None, lsl: int = -1
) -> dict:
    """The engine loop's request for one prompt (``text`` or ``input_ids``) of an OpenAI body:
    a fresh ``<kind>-<hex>`` id and the body's sampling, logprob, salt and stream settings;
    ``lsl`` is the first prompt position to score (-1: none)."""
    return dict(
        prompt,
        rid=f"{kind}-{uuid.uuid4().hex}",
        sampling_params=body.sampling_params(max_tokens),
        return_logprob=logprobs,
        logprob_start_len=lsl,
        top_logprobs_num=top or 0,
        cache_salt=body.cache_salt,
        stream=body.stream,
    )


async def _respond(
    s: ServerState,
    request: Request,
    reqs: list[dict],
    stream: bool,
    chunks: Callable[[Watch], AsyncIterator[bytes]],
    whole: Callable[[list[dict]], object],
) -> Response:
    """Queue the requests; stream SSE chunks, or wait for every output and answer once. A
    prefill server answers its role's outputs (``Disaggregation.run``), never streamed."""
    prefilled = await s.pd.run(s.loop, request, reqs)
    if prefilled is not None:
        return JSONResponse(await whole(prefilled))
    watch = Watch(s.loop, await s.loop.generate(reqs), request)
    if stream:
        return stream_response(watch, chunks(watch))
    outs = await wait_whole(watch)
    if outs is None:
        return error_response(499, "client closed the request")
    return JSONResponse(await whole(outs))
