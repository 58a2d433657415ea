"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Handlers raise `APIError`; the app's exception handlers turn it (and pydantic's validation
errors, which FastAPI would answer with 422) into this shape.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("quantkit.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), exc.status, headers=exc.headers)


def sse_error(status: int, message: str) -> str:
    """An error after the stream's headers went out: one `data:` event (the caller then sends [DONE])."""
    return f"data: {json.dumps(error_body(status, message), separators=(',', ':'))}\n\n"


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return json_error_message(first, exc.body)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return (f"{param}: {msg}" if param else msg), param


def json_error_message(error: dict, document) -> tuple[str, str]:
    """A body that is not JSON: the decoder's complaint and where (FastAPI's error holds the offset and the
    document), as json.JSONDecodeError words it; param "body.<offset>" as vLLM sets it."""
    pos = error["loc"][-1]
    doc = document.decode(errors="replace") if isinstance(document, bytes) else str(document or "")
    line, column = doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)
    what = (error.get("ctx") or {}).get("error", "not valid JSON")
    return f"JSON decode error in the request body: {what}: line {line} column {column} (char {pos})", f"body.{pos}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))
