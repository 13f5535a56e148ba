"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal names the field, the value and what was expected; nothing the
server answers carries a traceback (an unexpected failure is logged on
stderr and answered 500 in one line).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

__all__ = ["APIError", "error_body", "install_handlers", "shown", "validation_error"]

log = logging.getLogger("graphrunner.serve")

#: OpenAI's error ``type`` by HTTP status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
    500: "internal_server_error",
}


class APIError(Exception):
    """A request answered with an error object.

    Args:
        status: the HTTP status.
        message: what was wrong: the field, the value, what was expected.
        param: the request field at fault (None: the request as a whole).
        code: a short machine-readable code (None: none).
        headers: extra response headers (``Retry-After`` on a 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        """This error as the HTTP response."""
        body = error_body(self.message, self.status, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def error_body(
    message: str, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object (also what a stream's error event carries)."""
    kind = _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def shown(value: Any) -> str:
    """A field's value (from a JSON body) for a message, cut to 60 characters:
    a text as Python quotes it, anything else as JSON."""
    return _cut(repr(value) if isinstance(value, str) else json.dumps(value))


def _shown(value: Any) -> str:
    """pydantic's input for a message: JSON where it is JSON, else its repr."""
    return _cut(json.dumps(value) if _jsonable(value) else repr(value))


def _cut(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def validation_error(errors: Sequence[Mapping[str, Any]], prefix: Sequence[str] = ()) -> APIError:
    """A 400 naming the first of pydantic's ``errors``: the field (dotted,
    list indices in brackets), the value received and what was expected."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if str(p) not in prefix and not _union_tag(p)]
    field = ""
    for part in loc:
        field += f"[{part}]" if part.isdigit() else (f".{part}" if field else part)
    kind = first.get("type", "")
    if kind == "missing":
        return APIError(400, f"{field}: missing; expected it in the request body", param=field)
    if kind == "extra_forbidden":
        return APIError(
            400, f"{field}: not a field graphrunner serve takes; expected none of it", param=field
        )
    msg = str(first.get("msg", "invalid")).replace("Input should be", "expected")
    got = _shown(first.get("input"))
    return APIError(400, f"{field or 'request body'}={got}: {msg}", param=field or None)


#: What pydantic puts in an error's location for the member of a union it tried.
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _union_tag(part: object) -> bool:
    text = str(part)
    return isinstance(part, str) and (text in _TYPE_NAMES or "[" in text)


def install_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape: ours, the router's (404, 405)
    and anything unexpected (500, logged, no traceback in the answer)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += "; expected /v1/models, /v1/completions, /v1/chat/completions, "
            message += "/tokenize, /detokenize, /version, /health or /metrics"
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("graphrunner serve: %s %s failed", request.method, request.url.path)
        message = f"internal error ({type(exc).__name__}); the server log has the details"
        return APIError(500, message).response()
