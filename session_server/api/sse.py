"""Server-sent events shared by the streaming front-ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from session_server.results import StreamEvent

DONE = b"data: [DONE]\n\n"


def data_line(payload: dict[str, Any]) -> bytes:
    return (
        b"data: "
        + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        + b"\n\n"
    )


def event_line(event: str, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {body}\n\n".encode()


async def first_then_rest(events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    """Pull the first event now, so errors before generation starts (bad input, unknown
    session, engine refusal) become ordinary HTTP errors instead of a broken stream."""
    first = await anext(events)

    async def chained() -> AsyncIterator[StreamEvent]:
        yield first
        async for event in events:
            yield event

    return chained()


def sse_response(
    chunks: AsyncIterator[bytes], on_error: Callable[[Exception], bytes]
) -> StreamingResponse:
    """Stream `chunks`; an error after the stream started is sent as one last event."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # the status line is gone: report in-band, as vLLM does
            yield on_error(exc)

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
