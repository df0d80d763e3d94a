"""Request limits, as pure ASGI middleware (nothing is buffered here), and the connection
limits uvicorn itself has no setting for.

A body whose Content-Length is over the limit is refused before a byte of it is read. A
chunked body is counted as it arrives; once it passes the limit, reading stops and the
answer is the same 413, whatever the front-end made of the cut-off body. Its JSON strings
are counted as it arrives too (quotes that no backslash escapes, two a string): parsing and
validating a body is one call that holds the GIL for about 2 us per item, so a body of
hundreds of thousands of tiny items is refused (413) before that call rather than stall every
other request for seconds. A body that is not
all there within `timeout_s` of the request's headers gets 408 the same way: a client that
sends headers and a few bytes would otherwise keep its request (and whatever it holds) open
for as long as it likes.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from session_server.api import errors


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, max_strings: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_strings = max_strings
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(scope, receive, send, 413, self._too_large)
            return
        received = 0
        quotes = _QuoteCount()
        refused: _Refused | None = None
        started = False
        complete = False
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def counted() -> Message:
            nonlocal received, refused, complete
            if complete:  # the body is read: what is left to receive is the disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                refused = _Refused(408, f"request body not received within {self.timeout_s:g} s")
                raise refused from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_bytes:
                    refused = _Refused(413, self._too_large)
                    raise refused
                if quotes.add(message.get("body", b"")) > 2 * self.max_strings:
                    refused = _Refused(
                        413,
                        f"request body holds more than this server's limit of "
                        f"{self.max_strings} JSON strings (keys and values)",
                    )
                    raise refused
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if refused is not None and not started:
                return  # the front-end's answer to a cut-off body: replaced by ours
            started = True
            await send(message)

        with contextlib.suppress(_Refused):
            await self.app(scope, counted, guarded)
        if refused is not None and not started:
            await _refuse(scope, receive, send, refused.status, refused.message)

    @property
    def _too_large(self) -> str:
        return f"request body larger than this server's limit of {self.max_bytes} bytes"


class _QuoteCount:
    """The quotes no backslash escapes in a body read in chunks: inside a JSON string a quote
    is always escaped (`\\"`), so these open and close strings. A quote after an escaped
    backslash (`\\\\"`) is taken for escaped: the count can only fall short, never refuse
    a body it should not."""

    def __init__(self) -> None:
        self.total = 0
        self._after_backslash = False

    def add(self, chunk: bytes) -> int:
        if chunk:
            escaped = chunk.count(b'\\"') + (self._after_backslash and chunk[:1] == b'"')
            self.total += chunk.count(b'"') - escaped
            self._after_backslash = chunk[-1:] == b"\\"
        return self.total


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    response = errors.error_response(Request(scope), status, message)
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


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a bound on a request's headers: uvicorn closes an
    idle connection only after a response (`timeout_keep_alive`), and any byte cancels that,
    so a connection that never sends a request, or sends half its headers, stayed open for
    ever. Here the headers must be complete within `header_timeout_s` of the connection's
    first moment or of the request's first byte, and within `max_header_bytes`; otherwise
    the connection is closed."""

    header_timeout_s = 10.0
    max_header_bytes = 64 << 10

    @classmethod
    def configured(cls, header_timeout_s: float, max_header_bytes: int) -> type[TimedHttpProtocol]:
        """The class uvicorn instantiates per connection, with these bounds."""
        bounds = {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes}
        return type(cls.__name__, (cls,), bounds)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._close)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _close(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # After the parser had them: the same bytes may hold the headers' end and the
        # body's start. Headers still unfinished are timed (the keep-alive timer stopped at
        # their first byte) and counted.
        if self._awaiting_headers:
            self._arm_header_timer()
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._close()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # The next request's headers are counted from its first byte (till then the
        # keep-alive timeout closes an idle connection).
        self._awaiting_headers = True
        self._header_bytes = 0
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)
