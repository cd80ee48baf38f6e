"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Every rejection the server makes goes through :class:`APIError`; kvstrata's own exceptions are
translated to it in one table (:func:`from_kvstrata`) at the HTTP boundary.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstrata.engine.scheduler import QueueFullError, SchedulerClosedError
from kvstrata.errors import (
    ConfigError,
    CorruptBlockError,
    KVStrataError,
    LayoutMismatchError,
    SessionBusyError,
    SessionConflictError,
    SessionExistsError,
    SessionNotFoundError,
    TierUnavailableError,
)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# (exception class, HTTP status, error type, code); the first matching row wins.
_KVSTRATA_ERRORS: list[tuple[type[KVStrataError], int, str, str]] = [
    (SessionNotFoundError, 404, "invalid_request_error", "session_not_found"),
    (SessionExistsError, 409, "invalid_request_error", "session_exists"),
    (SessionBusyError, 409, "invalid_request_error", "session_busy"),
    (SessionConflictError, 409, "invalid_request_error", "session_conflict"),
    (CorruptBlockError, 422, "invalid_request_error", "corrupt_archive"),
    (LayoutMismatchError, 422, "invalid_request_error", "layout_mismatch"),
    (ConfigError, 400, "invalid_request_error", "invalid_value"),
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (SchedulerClosedError, 503, "server_error", "shutting_down"),
    (TierUnavailableError, 503, "server_error", "tier_unavailable"),
    (KVStrataError, 500, "server_error", "internal_error"),
]


def from_kvstrata(exc: KVStrataError, *, param: str | None = None) -> APIError:
    for cls, status, kind, code in _KVSTRATA_ERRORS:
        if isinstance(exc, cls):
            return APIError(status, str(exc), type=kind, param=param, code=code)
    raise AssertionError("KVStrataError is the last row")


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _kvstrata_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, KVStrataError)
    return from_kvstrata(exc).response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
    if kind == "extra_forbidden":
        return APIError(
            400, f"unsupported parameter: {'.'.join(loc)}", param=".".join(loc), code="unsupported_parameter"
        ).response()
    reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{'.'.join(loc) or 'body'}: {reason}"
    return APIError(400, message, param=".".join(loc) or None, code="invalid_value").response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """The router's own refusals (no such route, a method the route does not take), OpenAI-shaped."""
    assert isinstance(exc, StarletteHTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and exc.detail == "Not Found":
        error = APIError(404, f"no such route: {where}", type="not_found_error", code="not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method not allowed: {where}" + (f" (allowed: {allowed})" if allowed else "")
        error = APIError(405, message, code="method_not_allowed")
    else:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind)
    response = error.response()
    if exc.status_code == 405 and exc.headers:
        response.headers.update(exc.headers)
    return response


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this response, so it is still logged with its trace.
    return APIError(500, "internal server error", type="server_error", code="internal_error").response()


HANDLERS: dict[type[Exception], Any] = {
    APIError: _api_error,
    KVStrataError: _kvstrata_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
    Exception: _unexpected,
}
