"""Errors in each API's own shape, and the mapping from core exceptions to HTTP statuses.

OpenAI clients (Chat Completions, Responses, Completions, session management) get
`{"error": {"message", "type", "param", "code"}}`; Anthropic clients (`/messages`) get
`{"type": "error", "error": {"type", "message"}}`. The front-end is chosen by path, so a
malformed body is reported in the shape the caller's SDK can read.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from session_server.api.session_ids import (
    AmbiguousCredentials,
    InvalidSessionId,
    MissingSessionId,
)
from session_server.conversation import ConversationError
from session_server.engines import EngineError
from session_server.store.base import SessionNotFound, StoreUnavailable, UnknownParent
from session_server.turns.errors import ProofFailed, Refused, SessionMissing

log = logging.getLogger(__name__)

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.retry_after_s = retry_after_s


def is_anthropic_path(path: str) -> bool:
    return path.endswith("/messages") or path.endswith("/messages/count_tokens")


def error_body(
    path: str, status: int, message: str, *, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    if is_anthropic_path(path):
        kind = type if type in _ANTHROPIC_TYPES.values() else None
        return {
            "type": "error",
            "error": {
                "type": kind or _ANTHROPIC_TYPES.get(status, "api_error"),
                "message": message,
            },
        }
    return {
        "error": {
            "message": message,
            "type": type or _OPENAI_TYPES.get(status, "server_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    request: Request,
    status: int,
    message: str,
    *,
    param: str | None = None,
    type: str | None = None,
    retry_after_s: int | None = None,
) -> JSONResponse:
    # The access log line names what went wrong (one line per failed request).
    request.state.error = message
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return JSONResponse(
        error_body(request.url.path, status, message, param=param, type=type),
        status_code=status,
        headers=headers,
    )


def retry_after(exc: Exception) -> int | None:
    """Seconds after which a transient failure (503, 429) may be retried, else None."""
    if isinstance(exc, StoreUnavailable | APIError | Refused):
        return exc.retry_after_s
    if isinstance(exc, EngineError) and exc.status == 503:
        return exc.retry_after_s or 1
    return None


def classify(exc: Exception) -> tuple[int, str, str | None, str | None]:
    """(status, message, param, type) for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc.status, exc.message, exc.param, exc.type
    if isinstance(exc, ConversationError):
        return exc.status, str(exc), exc.param, None
    if isinstance(exc, Refused):
        return exc.status, str(exc), exc.param, exc.kind
    if isinstance(exc, AmbiguousCredentials):
        return 400, str(exc), exc.header, None
    if isinstance(exc, InvalidSessionId | MissingSessionId):
        return 400, str(exc), "session_id", None
    if isinstance(exc, SessionMissing | SessionNotFound):
        return 404, f"session {exc.args[0]!r} not found", "session_id", None
    if isinstance(exc, EngineError):
        return exc.status, exc.message, None, exc.type
    if isinstance(exc, ProofFailed):
        return 502, str(exc), None, "engine_error"
    if isinstance(exc, StoreUnavailable):
        return 503, str(exc), None, None
    if isinstance(exc, UnknownParent):
        # The session changed under the request (deleted and created again meanwhile).
        return 409, f"concurrent change to the session: {exc}; nothing was stored", None, None
    log.exception("unhandled error", exc_info=exc)
    return 500, f"internal error: {type(exc).__name__}", None, "server_error"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        # The parser's reason tells a client what to fix (e.g. "recursion limit exceeded").
        reason = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
        return f"the request body is not valid JSON: {reason}", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, str(exc.detail))

    async def _core(request: Request, exc: Exception) -> JSONResponse:
        status, message, param, kind = classify(exc)
        return error_response(
            request, status, message, param=param, type=kind, retry_after_s=retry_after(exc)
        )

    for exc_type in (
        APIError,
        AmbiguousCredentials,
        ConversationError,
        InvalidSessionId,
        MissingSessionId,
        SessionMissing,
        SessionNotFound,
        EngineError,
        ProofFailed,
        Refused,
        StoreUnavailable,
        UnknownParent,
    ):
        app.add_exception_handler(exc_type, _core)
