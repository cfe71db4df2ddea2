"""Every error leaves the server in one shape, OpenAI's (which the ``openai`` client reads):

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": 400}}

Bad input is a 4xx whose message says what is wrong; nothing a client sends can take the
server down.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hicache_jax.sampling_params import InvalidRequest

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def describe_validation_errors(errors, under_body: bool = False) -> str:
    """pydantic's error list -> one readable line (``field: what is wrong; ...``).
    ``under_body``: FastAPI's errors, whose locations start with ``"body"`` (only that first
    entry goes: a field may itself be named ``body``)."""
    parts = []
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ())]
        if under_body and loc[:1] == ["body"]:
            loc = loc[1:]
        where = ".".join(loc)
        kind = e.get("type", "")
        if kind == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "invalid JSON")
            if reason.startswith("recursion limit exceeded"):
                reason = f"nested deeper than JSON bodies may nest ({reason})"
            parts.append(f"malformed JSON body: {reason}")
        elif kind == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        elif kind in ("model_type", "model_attributes_type") and not where:
            parts.append("the body must be a JSON object")
        elif kind == "missing":
            parts.append(f"missing field {where!r}")
        else:
            parts.append(f"{where}: {e.get('msg', kind)}" if where else e.get("msg", kind))
    return "; ".join(dict.fromkeys(parts))


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(400, describe_validation_errors(exc.errors(), under_body=True))

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        return error_response(exc.status, str(exc))  # 400, or 503 for a full queue

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
