"""Who may call what: credentials by role, checked before a request reaches a front-end.

- The admin key (`--admin-key` / `TOKENKEEP_ADMIN_KEY`) opens everything: session management,
  listing, export, `POST /sessions`, and any session's model APIs.
- A session key (`tks-<secret>.<session id>`, issued once by `POST /sessions` as `api_key`,
  stored only as a SHA-256 digest) opens that one session's model APIs, plus the
  session-less utilities (`/v1/models`, `/tokenize`, `/detokenize`). The session id inside
  it only routes the request; the secret (256 random bits) is what is checked.
- `tk-<session id>` is a credential only with `--session-id-keys`: anyone who knows a
  session id can derive it, so it is for trusted setups (a harness image that can only be
  given an API key and no prior `POST /sessions`).
- `/healthz`, `/readyz` and `/metrics` need nothing, nor do the viewer's pages (`/ui/`,
  `/ui/sessions/<id>`, `/ui/static/...`); the viewer's data (`/ui/api/...`) needs the admin key.

With no admin key the server is in protected mode (as Redis is): loopback clients need no
credentials (a development default), everyone else is refused, and `tokenkeep serve`
refuses to listen on a non-loopback address unless `--insecure` says that is intended.
"""

from __future__ import annotations

import hmac
import re

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from session_server.api import errors
from session_server.api.session_ids import (
    API_KEY_PREFIX,
    AmbiguousCredentials,
    InvalidSessionId,
    check_session_id,
    presented,
    session_of_key,
)
from session_server.keys import key_digest
from session_server.settings import Settings, is_loopback
from session_server.turns.service import TurnService
from session_server.turns.sessions import session_key_request

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
ANY_CREDENTIAL_PATHS = frozenset({"/v1/models", "/tokenize", "/detokenize"})
# A session's model APIs: the OpenAI/Anthropic ones under /v1/, vLLM's token-in generate
# under /inference/v1/.
_SESSION_PATH = re.compile(r"^/sessions/([^/]*)/(?:inference/)?v1/")


def is_open(path: str) -> bool:
    """Probes, and the viewer's pages and static files: they hold no session data (the
    viewer's data, `/ui/api/...`, needs the admin key like the export), and a browser must
    load them before it can be given a key."""
    if path in OPEN_PATHS or path == "/ui":
        return True
    return path.startswith("/ui/") and not path.startswith("/ui/api/")


def _same(a: str, b: str) -> bool:
    encoded = [s.encode("utf-8", "surrogatepass") for s in (a, b)]
    return hmac.compare_digest(encoded[0], encoded[1])


class Guard:
    """Pure ASGI middleware: authenticates and authorises from the headers alone, so a
    refused request is answered before its body is read."""

    def __init__(self, app: ASGIApp, settings: Settings, service: TurnService) -> None:
        self.app = app
        self.settings = settings
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            refusal = await self._refusal(scope)
        except Exception as exc:  # the store could not be asked about a session key
            refusal = errors.classify(exc)[:2]
        if refusal is None:
            marked = session_key_request.set(scope.get("tokenkeep.session_key"))
            try:
                await self.app(scope, receive, send)
            finally:
                session_key_request.reset(marked)
            return
        status, message = refusal
        response = errors.error_response(Request(scope), status, message)
        if status == 401:
            response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    async def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        settings = self.settings
        # Parsed here for every request (protected mode too), once: the front-ends read the
        # same result, so the key checked is the key whose session is served.
        try:
            found = presented(scope)
        except AmbiguousCredentials as exc:
            return 400, str(exc)
        if not settings.admin_key:
            client = scope.get("client")
            if settings.insecure or is_loopback(client[0] if client else None):
                return None
            return 403, (
                "protected mode: this server has no admin key, so it answers loopback "
                "clients only (configure --admin-key, or --insecure)"
            )
        key = found.key
        if not key:
            return 401, "missing API key (Authorization: Bearer <key> or x-api-key: <key>)"
        if _same(key, settings.admin_key):
            return None
        holder, digest = await self._key_session(key)
        if holder is None:
            return 401, "wrong or expired API key"
        path = scope["path"]
        if path in ANY_CREDENTIAL_PATHS:
            return None
        if path.startswith(("/v1/", "/inference/v1/")):
            target = found.session_header or holder
        elif match := _SESSION_PATH.match(path):
            target = match.group(1)
        else:
            return 403, "this endpoint needs the admin key; a session key opens its model APIs"
        if target != holder:
            return 403, "this API key opens only its own session"
        scope["tokenkeep.session_key"] = digest
        return None

    async def _key_session(self, key: str) -> tuple[str | None, str | None]:
        """The session a session credential opens (None if it opens nothing), and the
        digest of the key when it is a session key (checked again by the turn's lookup;
        "" for a `tk-` key, which any holder of the session id can derive)."""
        if key.startswith(API_KEY_PREFIX) and self.settings.session_id_keys:
            return key[len(API_KEY_PREFIX) :], ""
        session_id = session_of_key(key)
        if session_id is None:
            return None, None
        try:
            check_session_id(session_id)
        except InvalidSessionId:
            return None, None
        digest = key_digest(key)
        if await self.service.sessions.keyed(session_id, digest) is None:
            return None, None
        return session_id, digest
