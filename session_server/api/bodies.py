"""Reading a front-end's JSON request body.

Bodies are read by hand rather than declared as FastAPI parameters so that a malformed one
is reported in the calling API's own error shape, not FastAPI's 422.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from session_server.conversation import ConversationError


async def json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise ConversationError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ConversationError("request body must be a JSON object")
    return body
