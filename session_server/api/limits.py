"""The request body size limit, as pure ASGI middleware (nothing is buffered here).

A body whose Content-Length is over the limit is refused before a byte of it is read. A
chunked body is counted as it arrives; once it passes the limit, reading stops and the
answer is the same 413, whatever the front-end made of the cut-off body.
"""

from __future__ import annotations

import contextlib

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_server.api import errors


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received = 0
        exceeded = False
        started = False

        async def counted() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise _TooLarge
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # the front-end's answer to a truncated body: replaced by the 413
            started = True
            await send(message)

        with contextlib.suppress(_TooLarge):
            await self.app(scope, counted, guarded)
        if exceeded and not started:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body larger than this server's limit of {self.max_bytes} bytes"
        response = errors.error_response(Request(scope), 413, message)
        # The rest of the body is never read: the connection closes after the answer.
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
