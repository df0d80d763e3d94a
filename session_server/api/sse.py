"""Server-sent events shared by the streaming front-ends."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from session_server.api.errors import classify, error_body
from session_server.api.routing import dumps
from session_server.conversation import Conversation, ConversationError, Idempotency
from session_server.results import StreamEvent, TurnResult

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


def sse_response(
    chunks: AsyncIterator[bytes],
    on_error: Callable[[Exception], bytes],
    *,
    upstream: AsyncIterator[StreamEvent],
) -> StreamingResponse:
    """Stream `chunks` (formatted from `upstream`); an error after the stream started is sent
    as one last event. When the client goes away, `upstream` is closed at once, which closes
    the engine request and stops its generation (nothing is stored for it)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # the status line is gone: report in-band, as vLLM does
            status, message, _param, _kind = classify(exc)
            log.warning(
                dumps({"event": "stream_failed", "status": status, "error": message}).decode()
            )
            yield on_error(exc)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await upstream.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


MAX_IDEMPOTENCY_KEY_BYTES = 255
IDEMPOTENCY_KEY_DOC = {
    "parameters": [
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_BYTES},
            "description": "Scoped to the session: a resend with the same key and body gets "
            "the stored reply (same id, message, tokenkeep.turn_ids; no engine call, no new "
            "turn), waiting while the first is still generating; another body gets 422. "
            "Read by hand (not a FastAPI parameter) so the turn route stays lean.",
        }
    ]
}


async def idempotency(request: Request) -> Idempotency | None:
    """The request's `Idempotency-Key` (scoped to its session) with its body's fingerprint."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not key or len(key.encode()) > MAX_IDEMPOTENCY_KEY_BYTES:
        raise ConversationError(
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_BYTES} bytes",
            param="Idempotency-Key",
        )
    return Idempotency(key, hashlib.sha256(await request.body()).hexdigest())


async def serve_turn(
    request: Request,
    session_id: str,
    api: str,
    conversation: Conversation,
    *,
    streaming: bool,
    complete: Callable[[], Awaitable[TurnResult]],
    stream: Callable[[], AsyncIterator[StreamEvent]],
    reply: Callable[[TurnResult], Any],
    frames: Callable[[AsyncIterator[StreamEvent]], AsyncIterator[bytes]],
    on_error: Callable[[Exception], bytes],
) -> Any:
    """What every front-end does with a parsed request: one turn, answered whole or streamed
    in that API's frames; the request is labelled for the access log and metrics."""
    request.state.session_id = session_id
    request.state.api = api
    conversation.idempotency = await idempotency(request)
    conversation.arrived = request.scope.get("state", {}).get("arrived")
    if not streaming:
        result = await complete()
        request.state.turn_kind = result.kind
        return reply(result)
    events = await first_then_rest(stream())
    return sse_response(frames(events), on_error, upstream=events)
