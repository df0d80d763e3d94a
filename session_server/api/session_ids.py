"""Where a request's session id comes from, for every front-end.

`/sessions/{session_id}/...` carries it in the path. The same endpoints at `/v1/...` take it
from an `X-Session-ID` header, or from the API key: a session key (`tks-<secret>.<id>`,
see `session_server.api.auth`) or `tk-<session_id>` (every harness lets its user set an API
key: OpenAI clients send `Authorization: Bearer`, Anthropic clients send `x-api-key`).
Whether the key is also accepted as a credential is `auth`'s decision, made before this.
"""

from __future__ import annotations

import re

from fastapi import Request

SESSION_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
API_KEY_PREFIX = "tk-"
SESSION_KEY_PREFIX = "tks-"


class InvalidSessionId(ValueError):
    """Maps to HTTP 400 in the API's own error shape."""


class MissingSessionId(ValueError):
    """Maps to HTTP 400: a `/v1/...` request that names no session."""


def check_session_id(session_id: str) -> str:
    if not SESSION_ID_PATTERN.fullmatch(session_id):
        raise InvalidSessionId(
            "session ids are 1-128 characters of [A-Za-z0-9._-], got " + repr(session_id[:140])
        )
    return session_id


def session_id_from_headers(request: Request) -> str:
    header = request.headers.get("x-session-id")
    if header:
        return check_session_id(header.strip())
    key = presented_key(request.headers.get("x-api-key"), request.headers.get("authorization"))
    if key:
        from_key = session_of_key(key)
        if from_key is not None:
            return check_session_id(from_key)
        if key.startswith(API_KEY_PREFIX):
            return check_session_id(key[len(API_KEY_PREFIX) :])
    raise MissingSessionId(
        "no session: use /sessions/{id}/v1 as the base URL, send an X-Session-ID header, "
        "or use the session's API key"
    )


def presented_key(x_api_key: str | None, authorization: str | None) -> str | None:
    """The API key a client sent: Anthropic clients use x-api-key, OpenAI clients Bearer."""
    return (x_api_key or "").strip() or bearer_token(authorization)


def session_of_key(key: str) -> str | None:
    """The session id a session key names (`tks-<secret>.<id>`), unchecked; None otherwise."""
    if not key.startswith(SESSION_KEY_PREFIX):
        return None
    secret, dot, session_id = key[len(SESSION_KEY_PREFIX) :].partition(".")
    return session_id if secret and dot and session_id else None


def bearer_token(value: str | None) -> str | None:
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None
