"""A lean HTTP/1.1 keep-alive client for the engine requests (plain `http://` engines).

httpx costs a served turn far more Python than the request itself: with any transport, each
request builds an `httpx.Request` and `httpx.Response` (URL parsing and merging, header
normalisation, a cookie jar run through `urllib.request` and `email` parsing), ~300 function
calls; its default transport (httpcore over anyio) adds cancel scopes, h11 events and two
system calls per request. This client is an `asyncio.Protocol` with httptools' C parser
(uvicorn's, already a dependency): what can be is computed once per replica and path (where
to connect, the request line and static headers, `Endpoint`), each request is one write, the
reply's body is handed over as it arrives, and the connection is kept for the next request.
Its reply (`LeanResponse`) has the few members the engine client reads (`EngineReply`), as
httpx's `Response` has, so an `https://` engine (or a transport a test passes) goes through
httpx with the same code.

Timeouts follow the engine client's `httpx.Timeout`: `pool` (waiting for a connection slot),
`connect`, `read` (between two pieces of the reply). Failures raise httpx's exception classes
(`PoolTimeout`, `ConnectTimeout`, `ConnectError`, `ReadTimeout`, `ReadError`,
`RemoteProtocolError`), so retries and marking down are the same whichever way a request went.
The request asks for an uncompressed reply (`accept-encoding: identity`): nothing decodes one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, cast

import httptools
import httpx


class EngineReply(Protocol):
    """What the engine client reads of a reply: `LeanResponse`, or httpx's `Response`."""

    @property
    def status_code(self) -> int: ...

    async def aread(self) -> bytes: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One URL to POST to, prepared once: where to connect, and the request's head up to
    the headers that change per request."""

    host: str
    port: int
    head: bytes

    @staticmethod
    def of(url: str, headers: dict[str, str]) -> Endpoint | None:
        """`url`'s endpoint with these fixed headers; None unless it is plain `http://`
        without credentials (httpx turns those into basic auth)."""
        parsed = httpx.URL(url)
        if parsed.scheme != "http" or parsed.userinfo:
            return None
        lines = [b"POST %s HTTP/1.1\r\nhost: %s\r\n" % (parsed.raw_path, parsed.netloc)]
        lines += (b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items())
        return Endpoint(parsed.raw_host.decode("ascii"), parsed.port or 80, b"".join(lines))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: LeanClient) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.key: tuple[str, int] = ("", 0)
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
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
        self.pool.forget(self)

    # httptools callbacks (the reply's headers are not read: no `on_header`)
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
        """Until more of the reply (or its end, or a failure) has arrived. The read timeout
        is one timer that fails the wait (cheaper than `asyncio.timeout`'s cancellation)."""
        waiter = self._waiter = self.loop.create_future()
        timer = None if timeout is None else self.loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def send(self, head: bytes, body: bytes) -> None:
        self._reset()
        assert self.transport is not None
        if self.closed or self.transport.is_closing():
            self._fail(httpx.RemoteProtocolError("the engine connection is closed"))
            return
        self.transport.writelines((head, body))  # one system call, the body not copied

    def reusable(self) -> bool:
        return not self.closed and self.complete and self.error is None and self.keep_alive

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout("the engine sent nothing within the read timeout"))


class LeanResponse:
    """A reply whose head has arrived. Read it once, with `aread` or `aiter_bytes`; `aclose`
    (always, also after reading) gives the connection back, or closes it if the reply was
    not read to its end: a stream left early is a closed connection, which makes vLLM abort
    the request."""

    __slots__ = ("_conn", "_pool", "_read_timeout", "_released", "status_code")

    def __init__(self, pool: LeanClient, conn: _Connection, read_timeout: float | None) -> None:
        self.status_code = conn.status
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._released = False

    async def aread(self) -> bytes:
        conn = self._conn
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout)
        chunks = conn.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._release()
        return body

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        conn = self._conn
        chunks = conn.chunks
        while True:
            while chunks:
                yield chunks.popleft()
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout)
        self._release()

    async def aclose(self) -> None:
        self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._pool.release(self._conn)


class LeanClient:
    """A pool of at most `max_connections` engine connections (idle ones kept for
    `keepalive_expiry` seconds), requests bounded by `timeout`'s pool, connect and read."""

    def __init__(
        self, *, timeout: httpx.Timeout, max_connections: int, keepalive_expiry: float
    ) -> None:
        self._pool_timeout = timeout.pool
        self._connect_timeout = timeout.connect
        self._read_timeout = timeout.read
        self._expiry = keepalive_expiry
        self._free = max_connections  # connection slots not taken by a request
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def post(self, endpoint: Endpoint, headers: bytes, body: bytes) -> LeanResponse:
        """POST `body` with the endpoint's head plus `headers` (whole `name: value\\r\\n`
        lines); returns once the reply's head has arrived."""
        if self._free > 0:
            self._free -= 1
        else:
            await self._wait_for_slot()
        conn: _Connection | None = None
        try:
            conn = self._idle_connection(endpoint) or await self._connect(endpoint)
            conn.send(b"%s%scontent-length: %d\r\n\r\n" % (endpoint.head, headers, len(body)), body)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._read_timeout)
        except BaseException:
            if conn is not None:
                conn.close()
                self._open.discard(conn)
            self._release_slot()
            raise
        return LeanResponse(self, conn, self._read_timeout)

    async def _wait_for_slot(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            async with asyncio.timeout(self._pool_timeout):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed a slot just as it gave up: pass it on
            else:
                waiter.cancel()
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise httpx.PoolTimeout(
                    "no free engine connection within the pool timeout"
                ) from None
            raise

    def _release_slot(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot goes to the longest waiting request
                return
        self._free += 1

    def _idle_connection(self, endpoint: Endpoint) -> _Connection | None:
        idle = self._idle.get((endpoint.host, endpoint.port))
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._expiry:
                return conn
            conn.close()
            self._open.discard(conn)
        return None

    async def _connect(self, endpoint: Endpoint) -> _Connection:
        host, port = endpoint.host, endpoint.port
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self), host, port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        conn.key = (host, port)
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
        self._release_slot()

    def forget(self, conn: _Connection) -> None:
        """The engine closed `conn` (if it was idle, it no longer waits in the pool)."""
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()
