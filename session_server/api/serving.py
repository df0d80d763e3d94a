"""Serving a turn request, for every front-end: its Idempotency-Key, one turn answered whole
or streamed in the API's own frames (`sse.EventStream`), a client that hangs up before the
answer starts taking its turn with it, and the request labelled for the access log."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from session_server.api.sse import DisconnectWatch, EventStream, first_then_rest
from session_server.conversation import Conversation, ConversationError, Idempotency
from session_server.results import StreamEvent, TurnResult

CLIENT_CLOSED = 499
"""The access log's status of a turn whose client hung up before its answer (nginx's)."""


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
    turn = asyncio.current_task()
    assert turn is not None
    # The body is read: what the connection says now is whether the client is still there.
    # One that hangs up before its answer starts takes the turn (its engine request, its
    # slot) with it, as a streamed turn's client does later on (EventStream).
    watch = DisconnectWatch(request.receive, turn)
    try:
        if streaming:
            events = await first_then_rest(stream())
        else:
            result = await complete()
    except asyncio.CancelledError:
        if watch.cut(turn):
            request.state.error = "client disconnected"
            return Response(status_code=CLIENT_CLOSED)
        raise
    finally:
        watch.stop()
    if streaming:
        return EventStream(frames(events), on_error, events)
    request.state.turn_kind = result.kind
    return reply(result)
