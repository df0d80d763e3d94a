"""Failures as each API reports them.

Every front-end turns an exception into one `ApiFailure` (status, message, type, param) and
then into its own wire shape: OpenAI's `{"error": {"message", "type", "param", "code"}}` for
Chat Completions, Responses and Completions, Anthropic's
`{"type": "error", "error": {"type", "message"}}` for Messages. Harness SDKs pick their
exception class from the status and read the message from that shape, so both must match
the real APIs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from session_server.api.session_ids import InvalidSessionId, MissingSessionId
from session_server.conversation import ConversationError
from session_server.store.base import SessionNotFound


@dataclass(slots=True, frozen=True)
class ApiFailure:
    status: int
    message: str
    type: str = "invalid_request_error"
    """OpenAI's error type vocabulary; Anthropic's is derived from the status."""
    param: str | None = None


def failure_from_exception(exc: BaseException) -> ApiFailure | None:
    """The failure a known exception stands for; None for a bug (let it propagate)."""
    if isinstance(exc, ValidationError):
        return failure_from_validation(exc)
    if isinstance(exc, ConversationError):
        return ApiFailure(400, str(exc), param=exc.param)
    if isinstance(exc, InvalidSessionId | MissingSessionId):
        return ApiFailure(400, str(exc), param="session_id")
    if isinstance(exc, SessionNotFound):
        return ApiFailure(
            404, f"session {exc.args[0] if exc.args else ''} not found", type="not_found_error"
        )
    status = getattr(exc, "status", None)
    message = getattr(exc, "message", None)
    if isinstance(status, int) and isinstance(message, str):
        # session_server.engines.EngineError (the engine's own status and message).
        return ApiFailure(status, message, type=getattr(exc, "type", None) or "api_error")
    return None


def failure_from_validation(exc: ValidationError) -> ApiFailure:
    """One problem pydantic found, located the way both APIs' messages do
    (`messages.0.content.1.type: ...`). Of several, the one that got deepest into the
    request names the real mistake."""
    worst = max(exc.errors(include_url=False), key=lambda error: len(error["loc"]))
    location = ".".join(str(part) for part in worst["loc"])
    message = f"{location}: {worst['msg']}" if location else worst["msg"]
    return ApiFailure(400, message, param=location or None)


def openai_error(failure: ApiFailure) -> JSONResponse:
    return JSONResponse(openai_error_body(failure), status_code=failure.status)


def openai_error_body(failure: ApiFailure) -> dict[str, Any]:
    return {
        "error": {
            "message": failure.message,
            "type": failure.type,
            "param": failure.param,
            "code": str(failure.status),
        }
    }


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(failure: ApiFailure) -> JSONResponse:
    return JSONResponse(anthropic_error_body(failure), status_code=failure.status)


def anthropic_error_body(failure: ApiFailure) -> dict[str, Any]:
    if failure.status in _ANTHROPIC_TYPES:
        kind = _ANTHROPIC_TYPES[failure.status]
    else:
        kind = "invalid_request_error" if failure.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": failure.message}}
