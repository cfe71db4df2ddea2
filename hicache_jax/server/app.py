"""The HTTP app: SGLang's native routes here, OpenAI's in ``openai_api``.

POST /generate          text | input_ids (single or batched), sampling_params, stream, ...
POST /flush_cache       wait (at most --flush_cache_wait_s) for idle, clear L1 + L2 (L3 stays)
POST /clear_storage     clear this model's L3 pages ({"all_namespaces": true}: every model's)
POST /pause_generation  stop stepping (requests are still accepted; aborts still free pages)
POST /continue_generation  step again
POST /start_profile     start a jax.profiler trace ({output_dir?, num_steps?}: a directory under
                        --profile_dir); /stop_profile ends it
GET  /health  /model_info  /server_info  /metrics (Prometheus); /get_model_info and
     /get_server_info are the older names

With --api_key every route but /health needs it, the admin routes above included. Every route
that changes state is POST only; ``request_guard.py`` says what else is refused before a route
runs (browser-only Content-Types; without a key, foreign Host and Origin headers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

import hicache_jax
from hicache_jax.server import errors, metrics
from hicache_jax.server.errors import ApiError, error_response
from hicache_jax.server.openai_api import router as openai_router
from hicache_jax.server.profiler import ProfileError, check_quota, confine
from hicache_jax.server.prompt_size import tokenize_texts
from hicache_jax.server.protocol import ClearStorageRequest, GenerateRequest, ProfileRequest, parse_body
from hicache_jax.server.request_guard import RequestGuard, allowed_hosts
from hicache_jax.server.state import ServerState
from hicache_jax.server.streaming import (
    CumulativeStream,
    Watch,
    stream_response,
    wait_whole,
)

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (load balancer probes)


class ApiKeyAuth:
    """Pure ASGI middleware (a BaseHTTPMiddleware would wrap ``receive`` and hide client
    disconnects from streaming handlers): every path but /health needs the bearer key."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                msg = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                resp = error_response(401, msg, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        yield
        state.loop.stop()

    app = FastAPI(title="hicache-jax", version=hicache_jax.__version__, lifespan=lifespan)
    app.state.server = state
    errors.install(app)
    cfg = state.server_cfg
    if cfg.api_key:
        app.add_middleware(ApiKeyAuth, api_key=cfg.api_key)
    hosts = allowed_hosts(cfg.host, cfg.allowed_hosts)
    app.add_middleware(RequestGuard, hosts=hosts, check_hosts=not cfg.api_key)  # outermost: runs first

    @app.get("/health")
    async def health() -> Response:
        if not state.loop.healthy:
            return error_response(
                503, "the engine is not usable: a step failed and device state is being rebuilt"
            )
        return JSONResponse({"status": "ok"})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return state.model_info

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return server_info(state, await _metrics(state))

    @app.get("/metrics")
    async def get_metrics() -> Response:
        text = metrics.render(await _metrics(state), model_name=state.served_model_name)
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        result = await state.loop.flush()
        if not result.success:
            raise ApiError(500 if result.failed else 400, result.message)
        return result.to_dict()  # with what the L3 drain did (writes drained / left queued)

    @app.post("/clear_storage")
    async def clear_storage(request: Request) -> dict:
        body = await parse_body(request, ClearStorageRequest, optional=True)
        ok, message = await state.loop.clear_storage(body.all_namespaces)
        if not ok:
            raise ApiError(400, message)
        return {"success": True, "message": message}

    @app.post("/pause_generation")
    async def pause_generation() -> dict:
        await state.loop.pause(True)
        return {"success": True, "message": "generation paused"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        await state.loop.pause(False)
        return {"success": True, "message": "generation continued"}

    @app.post("/start_profile")
    async def start_profile(request: Request) -> dict:
        body = await parse_body(request, ProfileRequest, optional=True)
        try:
            root = cfg.profile_output_dir()
            output_dir = confine(root, body.output_dir)
            check_quota(root, cfg.profile_max_traces, int(cfg.profile_max_mb * 2**20))
            await state.loop.start_profile(output_dir, body.num_steps)
        except ProfileError as e:
            raise ApiError(400, str(e)) from None
        return {"success": True, "message": f"profiling into {output_dir}", "output_dir": output_dir}

    @app.post("/stop_profile")
    async def stop_profile() -> dict:
        try:
            trace = await state.loop.stop_profile()
        except ProfileError as e:
            raise ApiError(400, str(e)) from None
        return {"success": True, "message": f"trace written to {trace['output_dir']}", **trace}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        reqs, batched = body.to_engine_requests(cfg.max_n)
        await tokenize_texts(reqs, state.chat.tokenizer, state.max_text_bytes)
        prefilled = await state.pd.run(state.loop, request, reqs)  # a prefill server's answer
        if prefilled is not None:
            return JSONResponse(prefilled if batched else prefilled[0])
        watch = Watch(state.loop, await state.loop.generate(reqs), request)
        if body.stream:
            return stream_response(watch, _events(watch, indexed=batched))
        outs = await wait_whole(watch)
        if outs is None:
            return error_response(499, "client closed the request")
        return JSONResponse(outs if batched else outs[0])

    app.include_router(openai_router)
    return app


async def _metrics(state: ServerState):
    """The engine loop's numbers and the server's own (``Disaggregation``)."""
    return (await state.loop.metrics()).add(state.pd.counters)


def server_info(state: ServerState, metrics: dict) -> dict:
    """SGLang's flat server arguments (what sglang-router reads: model_path, served_model_name,
    tp_size, dp_size, page_size, max_total_tokens, max_running_requests, ...), then ours
    nested as before."""
    server = dataclasses.asdict(state.server_cfg)
    server["api_key"] = "<set>" if server["api_key"] else None  # never echo the secret
    server["max_request_body_bytes"] = state.max_body_bytes  # prompt_size.py
    server["max_prompt_text_bytes"] = state.max_text_bytes
    engine = dataclasses.asdict(state.engine_cfg)
    flat = {
        **engine,
        **server,
        "served_model_name": state.served_model_name,
        "context_length": state.context_len,
        "dp_size": 1,
        "pp_size": 1,
        "is_embedding": False,
        "disaggregation_mode": state.engine_cfg.disaggregation_mode,
        "weight_version": "default",
        # The pages' dtype as resolved (engine_config keeps the flag as given, e.g. auto or
        # fp8), and the device KV bytes per token at it: what the pool's tokens cost.
        "kv_cache_dtype": state.model_info.get("kv_cache_dtype"),
        "kv_bytes_per_token": state.model_info.get("kv_bytes_per_token"),
    }
    return {
        **flat,
        "version": hicache_jax.__version__,
        "engine_config": engine,
        "server_config": server,
        "devices": state.devices,
        "model_info": state.model_info,
        "metrics": metrics,
    }


async def _events(watch: Watch, indexed: bool) -> AsyncIterator[bytes]:
    """SGLang's stream: each event carries the text and ids so far. The engine loop sends
    deltas; ``CumulativeStream`` adds them up. The n choices of a prompt (streaming takes
    one) stream side by side, each event with its choice's ``index`` (``indexed``)."""
    events = [CumulativeStream(i if indexed else None) for i in range(len(watch.sinks))]
    async for i, upd in watch.interleaved():
        yield events[i].event(upd.out)
