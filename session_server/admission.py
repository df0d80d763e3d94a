"""Admission control and draining for generation requests of one server process.

At most `max_inflight` generation requests run at once (each holds its slot until its answer,
streamed or whole, is sent); up to `max_queue` more wait for a slot for at most
`queue_timeout_s`. Past that a request is refused at once instead of queueing without bound:
429 when the queue is full, 503 when it waited too long, both with `Retry-After`. While the
process drains for shutdown, new generation requests get 503 and requests already admitted
finish. Only generation requests are counted: probes, metrics and session management never
wait behind turns.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_server.api.errors import error_response
from session_server.metrics import Metrics

_GENERATION_SUFFIXES = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/completions",
    "/inference/v1/generate",
)


class Rejected(Exception):
    def __init__(self, status: int, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(
        self,
        metrics: Metrics,
        *,
        max_inflight: int,
        max_queue: int,
        queue_timeout_s: float,
    ) -> None:
        if max_inflight < 1 or max_queue < 0:
            raise ValueError("max_inflight must be >= 1 and max_queue >= 0")
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.inflight = 0
        self.waiting = 0
        self.draining = False
        self._slots = asyncio.Semaphore(max_inflight)
        self._metrics = metrics
        metrics.inflight.set_function(lambda: self.inflight)
        metrics.queue_depth.set_function(lambda: self.waiting)

    def _reject(self, status: int, message: str, reason: str) -> Rejected:
        self._metrics.rejections.labels(reason=reason).inc()
        return Rejected(status, message, reason, retry_after_s=1)

    async def acquire(self) -> None:
        """Take a slot, waiting in the bounded queue if needed; raises Rejected."""
        if self.draining:
            raise self._reject(503, "the server is shutting down; retry", "draining")
        if self._slots.locked() or self.waiting:
            if self.waiting >= self.max_queue:
                raise self._reject(
                    429,
                    f"server overloaded: {self.inflight} requests running and "
                    f"{self.waiting} waiting; retry later",
                    "queue_full",
                )
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
            except TimeoutError:
                raise self._reject(
                    503,
                    f"server overloaded: no slot within {self.queue_timeout_s:g} s; retry later",
                    "queue_timeout",
                ) from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        self._slots.release()


def is_generation(scope: Scope) -> bool:
    return scope["method"] == "POST" and scope["path"].endswith(_GENERATION_SUFFIXES)


class AdmissionMiddleware:
    """ASGI middleware (not BaseHTTPMiddleware) so that a streamed answer keeps its slot
    until its last byte is sent."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_generation(scope):
            await self.app(scope, receive, send)
            return
        # When it arrived: an abort of its session recorded while it waits here cuts it.
        scope.setdefault("state", {})["arrived"] = time.time()
        # The body is read before a slot is taken: a client that sends headers and a few
        # bytes holds its connection (until the body timeout, api/limits.py), not a slot.
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # gone before its request was all there: nothing to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        try:
            await self.admission.acquire()
        except Rejected as exc:
            response: Any = error_response(
                Request(scope, replay), exc.status, exc.message, retry_after_s=exc.retry_after_s
            )
            await response(scope, receive, send)
            return
        try:
            await self.app(scope, replay, send)
        finally:
            self.admission.release()
