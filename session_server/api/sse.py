"""Server-sent events shared by the streaming front-ends: frames, the stream response that
writes them, and the watch that stops a turn whose client hung up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from session_server.api.errors import classify, error_body
from session_server.api.routing import dumps
from session_server.results import StreamEvent

log = logging.getLogger("tokenkeep.requests")
DONE = b"data: [DONE]\n\n"


def data_line(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


def openai_error_line(path: str) -> Callable[[Exception], bytes]:
    """How OpenAI-style streams report a failure after the 200: one `data:` error line."""

    def line(exc: Exception) -> bytes:
        status, message, param, kind = classify(exc)
        return data_line(error_body(path, status, message, param=param, type=kind))

    return line


def event_line(event: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + dumps(payload) + b"\n\n"


async def first_then_rest(events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    """Pull the first event now, so errors before generation starts (bad input, unknown
    session, engine refusal) become ordinary HTTP errors instead of a broken stream."""
    first = await anext(events)

    async def chained() -> AsyncIterator[StreamEvent]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return chained()


class EventStream(StreamingResponse):
    """Server-sent events: `chunks` (formatted from `upstream`) written as they come; an
    error after the stream started is sent as one last event. When the client goes away,
    `upstream` is closed at once, which closes the engine request and stops its generation
    (nothing is stored for it).

    Driven by hand rather than by Starlette's `StreamingResponse.__call__`: under an ASGI 2.3
    server (uvicorn) that runs the stream and a disconnect listener in an anyio task group
    (two tasks, cancel scopes, a task repr built for every cancel): 0.3 ms of server CPU a
    streamed turn, measured paired (`bench/results/served.md`, issue 22's third pass).
    Here the request's own task writes the chunks and one watcher task waits for the
    client's disconnect, which cancels the writer; that cancellation is absorbed (the
    client is gone: nothing left to answer), any other propagates."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        on_error: Callable[[Exception], bytes],
        upstream: AsyncIterator[StreamEvent],
    ) -> None:
        super().__init__(
            chunks,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_error = on_error
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        assert writer is not None
        watch = DisconnectWatch(receive, writer)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            try:
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception as exc:  # the status line is gone: report in-band, as vLLM does
                status, message, _param, _kind = classify(exc)
                log.warning(
                    dumps({"event": "stream_failed", "status": status, "error": message}).decode()
                )
                await send(
                    {"type": "http.response.body", "body": self.on_error(exc), "more_body": True}
                )
            finally:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.upstream.aclose()  # type: ignore[attr-defined]
            watch.armed = False  # all generated: a disconnect now cuts nothing
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if watch.cut(writer):
                return
            raise
        finally:
            watch.stop()


class DisconnectWatch:
    """Cancels `task` when the client disconnects (while `armed`): the engine request it
    awaits is closed with it, which is how vLLM learns to stop (it aborts a request whose
    connection closes), and the admission slot is freed. The task absorbs that cancellation
    with `cut` (the client is gone: nothing left to answer); any other propagates."""

    def __init__(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        self.armed = True
        self.gone = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive, task))

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a receive that fails tells no disconnect: the task goes on
            return
        if self.armed:
            self.gone = True
            task.cancel()

    def cut(self, task: asyncio.Task[Any]) -> bool:
        """After a CancelledError in `task`: whether it was this watch's (then absorbed)."""
        return self.gone and task.uncancel() == 0

    def stop(self) -> None:
        self._watcher.cancel()
