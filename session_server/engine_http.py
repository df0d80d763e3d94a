"""A lean HTTP/1.1 keep-alive transport for the engine requests (an httpx transport).

httpx's default transport (httpcore over anyio) was the largest share of a served turn's own
Python after the turn itself: cancel scopes, h11 events, a `get_running_loop` (a `getpid`
system call) per scope, and the request's head and body written by two system calls. This one
is an `asyncio.Protocol` with httptools' C parser (uvicorn's, already a dependency): one write
per request, the reply's body handed over as it arrives, the connection kept for the next
request. The client code stays httpx (`build_request`, `send(stream=True)`, `aread`,
`aiter_bytes`) and maps the same httpx exceptions, so retries and marking down are unchanged.

Timeouts follow the request's httpx timeout: `pool` (waiting for a connection slot), `connect`,
`read` (between two pieces of the reply). Plain `http://` only: an `https://` engine goes
through httpx's own transport, with the same limits.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import cast

import httptools
import httpx


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.key: tuple[str, int] = ("", 0)
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.keep_alive = False
        self.complete = False
        self.chunks: deque[bytes] = deque()
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid response from the engine: {exc}"))
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self.head_done:
                self._fail(httpx.ReadError("the engine closed the connection mid-response"))
            else:
                self._fail(
                    httpx.RemoteProtocolError("Server disconnected without sending a response.")
                )
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()  # not answered once complete
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until more of the reply (or its end, or a failure) has arrived."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._waiter
        except TimeoutError:
            raise httpx.ReadTimeout("the engine sent nothing within the read timeout") from None
        finally:
            self._waiter = None

    def send(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        if self.closed or self.transport.is_closing():
            self._fail(httpx.RemoteProtocolError("the engine connection is closed"))
            return
        self.transport.write(data)

    def reusable(self) -> bool:
        return not self.closed and self.complete and self.error is None and self.keep_alive

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: LeanTransport, conn: _Connection, read_timeout: float | None):
        self._pool = pool
        self._conn = conn
        self._timeout = read_timeout
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            while conn.chunks:
                yield conn.chunks.popleft()
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._timeout)
        await self.aclose()

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._pool.release(self._conn)


def _head(request: httpx.Request, body: bytes) -> bytes:
    target = request.url.raw_path
    lines = [request.method.encode(), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += (name, b": ", value, b"\r\n")
    if body and "content-length" not in request.headers:
        lines.append(b"content-length: %d\r\n" % len(body))
    lines.append(b"\r\n")
    return b"".join(lines)


class LeanTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, max_connections: int, keepalive_expiry: float) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._expiry = keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._tls = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=keepalive_expiry,
            )
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            return await self._tls.handle_async_request(request)
        timeout = request.extensions.get("timeout", {})
        body = await request.aread()
        try:
            async with asyncio.timeout(timeout.get("pool")):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no free engine connection within the pool timeout") from None
        conn: _Connection | None = None
        try:
            conn = await self._connection(request.url, timeout.get("connect"))
            conn.send(_head(request, body) + body)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(timeout.get("read"))
        except BaseException:
            if conn is not None:
                conn.close()
                self._open.discard(conn)
            self._slots.release()
            raise
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(self, conn, timeout.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _connection(self, url: httpx.URL, connect_timeout: float | None) -> _Connection:
        key = (url.host, url.port or 80)
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._expiry:
                return conn
            conn.close()
            self._open.discard(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(_Connection, key[0], key[1])
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        conn.key = key
        self._open.add(conn)
        return conn

    def release(self, conn: _Connection) -> None:
        """The reply was read to its end (the connection is kept) or abandoned (closed)."""
        if conn.reusable():
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.close()
            self._open.discard(conn)
        self._slots.release()

    async def aclose(self) -> None:
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()
        await self._tls.aclose()
