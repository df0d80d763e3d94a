"""Where a request's session id comes from, for every front-end.

`/sessions/{session_id}/...` carries it in the path. The same endpoints at `/v1/...` take it
from an `X-Session-ID` header, or from the API key: a session key (`tks-<secret>.<id>`,
see `session_server.api.auth`) or `tk-<session_id>` (every harness lets its user set an API
key: OpenAI clients send `Authorization: Bearer`, Anthropic clients send `x-api-key`).
Whether the key is also accepted as a credential is `auth`'s decision, made before this.

The guard and the front-ends read these headers through one function, `presented`, parsed
once per request: a request that carries two different copies of one of them, or an
`x-api-key` and a Bearer token that differ, is refused (400) rather than read one way by the
guard and another by the handler (which would let session A's key serve session B).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Request
from starlette.types import Scope

from session_server.keys import SESSION_KEY_PREFIX

SESSION_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
API_KEY_PREFIX = "tk-"


class InvalidSessionId(ValueError):
    """Maps to HTTP 400 in the API's own error shape."""


class MissingSessionId(ValueError):
    """Maps to HTTP 400: a `/v1/...` request that names no session."""


class AmbiguousCredentials(ValueError):
    """Maps to HTTP 400: the request names its key or its session more than one way."""

    def __init__(self, message: str, header: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True, slots=True)
class Presented:
    """What a request presents: its API key (x-api-key or Bearer) and X-Session-ID."""

    key: str | None
    session_header: str | None


_CREDENTIAL_HEADERS = (b"authorization", b"x-api-key", b"x-session-id")
_PRESENTED = "tokenkeep.presented"


def presented(scope: Scope) -> Presented:
    """The request's key and X-Session-ID, read once from the raw header list (kept in the
    scope for the front-end). Raises AmbiguousCredentials when a header comes twice with
    different values, or x-api-key and a Bearer token name different keys."""
    found = scope.get(_PRESENTED)
    if found is not None:
        return found
    values: dict[bytes, str] = {}
    for name, raw in scope["headers"]:
        if name.lower() not in _CREDENTIAL_HEADERS:
            continue
        name = name.lower()
        value = raw.decode("latin-1").strip()
        if values.setdefault(name, value) != value:
            header = name.decode()
            raise AmbiguousCredentials(
                f"the request carries more than one {header} header with different values; "
                "send one",
                header,
            )
    api_key = values.get(b"x-api-key") or None
    bearer = bearer_token(values.get(b"authorization"))
    if api_key and bearer and api_key != bearer:
        raise AmbiguousCredentials(
            "x-api-key and Authorization: Bearer carry different keys; send one", "x-api-key"
        )
    found = Presented(api_key or bearer, values.get(b"x-session-id") or None)
    scope[_PRESENTED] = found
    return found


def check_session_id(session_id: str) -> str:
    if not SESSION_ID_PATTERN.fullmatch(session_id):
        raise InvalidSessionId(
            "session ids are 1-128 characters of [A-Za-z0-9._-], got " + repr(session_id[:140])
        )
    return session_id


def session_id_from_headers(request: Request) -> str:
    found = presented(request.scope)
    if found.session_header:
        return check_session_id(found.session_header)
    key = found.key
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
