"""Server-sent events shared by the streaming front-ends.

A stream's HTTP status is sent before its first byte, so a request the core rejects (bad
conversation, unknown session, engine refusal) must fail before the response starts:
`started` waits for the core's first event and lets its exception through while the
front-end can still answer with a proper status and its API's error shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse

T = TypeVar("T")


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One event; `event:` is named for Anthropic and Responses streams, absent for Chat."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def started(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first event (raising what the core raised before anything was sent),
    then return an iterator over every event, that first one included."""
    first = await anext(events)

    async def replay() -> AsyncIterator[T]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            # A client that hangs up closes this iterator; close the core's one with it so
            # the engine request is cancelled now rather than at garbage collection.
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    return replay()


def event_stream(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        # Proxies (nginx, ingress) must not buffer a token stream.
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
