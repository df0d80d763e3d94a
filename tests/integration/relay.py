"""A recording relay in front of the real vLLM: what the session server sent, and what vLLM
itself reported back (the prompt token IDs it received, the tokens it sampled).

The session server already refuses an engine report that differs from its prompt; this relay
lets the tests check that independently, from the engine's side of the wire.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.trajectory_values import EngineSample

GENERATE_PATH = "/inference/v1/generate"


@dataclass
class Exchange:
    """One /generate call as both sides saw it."""

    sent_prompt: list[int]
    sampling: dict[str, Any]
    reported_prompt: list[int] | None = None
    sampled: dict[int, list[int]] = field(default_factory=dict)
    content_parts: list[dict[str, Any]] = field(default_factory=list)
    """The images sent with the prompt (vLLM's `content_parts`)."""
    mm_placeholders: dict[str, list[dict[str, int]]] | None = None
    """Where vLLM reports it put them in the expanded prompt."""
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    weight_versions: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)

    def samples(self) -> list[EngineSample]:
        """Each choice as vLLM returned it, for `tests/trajectory_values.py`."""
        return [
            EngineSample(
                tuple(self.sent_prompt),
                tuple(tokens),
                tuple(self.logprobs.get(index, ())),
                tuple(self.weight_versions.get(index, ())),
            )
            for index, tokens in sorted(self.sampled.items())
        ]


@dataclass
class Relay:
    engine_url: str
    exchanges: list[Exchange] = field(default_factory=list)

    def samples(self) -> list[EngineSample]:
        return [sample for exchange in self.exchanges for sample in exchange.samples()]

    def app(self) -> Starlette:
        client = httpx.AsyncClient(base_url=self.engine_url, timeout=600)

        async def forward(request: Request) -> Response:
            body = await request.body()
            exchange: Exchange | None = None
            if request.url.path == GENERATE_PATH:
                payload = json.loads(body)
                params = payload.get("sampling_params") or {}
                exchange = Exchange(
                    list(payload["token_ids"]),
                    params,
                    content_parts=payload.get("content_parts") or [],
                )
                self.exchanges.append(exchange)
            upstream = await client.send(
                client.build_request(
                    request.method,
                    request.url.path,
                    content=body,
                    headers={"content-type": request.headers.get("content-type", "")},
                ),
                stream=True,
            )
            media = upstream.headers.get("content-type", "application/json")
            if (
                exchange is None
                or upstream.status_code != 200
                or not media.startswith("text/event-stream")
            ):
                content = await upstream.aread()
                await upstream.aclose()
                if exchange is not None and upstream.status_code == 200:
                    _record(exchange, json.loads(content))
                return Response(content, upstream.status_code, media_type=media)
            recorded = exchange

            async def relay_events() -> Any:
                # Each event is recorded before it is passed on: the session server may answer
                # its client (and the test read the exchange) as soon as it has the last one.
                pending = b""
                try:
                    async for chunk in upstream.aiter_raw():
                        pending += chunk
                        *lines, pending = pending.split(b"\n")
                        for line in lines:
                            _record_line(recorded, line)
                        yield chunk
                    _record_line(recorded, pending)
                finally:
                    await upstream.aclose()

            return StreamingResponse(relay_events(), upstream.status_code, media_type=media)

        @contextlib.asynccontextmanager
        async def lifespan(_app: Starlette) -> AsyncIterator[None]:
            yield
            await client.aclose()

        return Starlette(
            routes=[Route("/{path:path}", forward, methods=["GET", "POST"])], lifespan=lifespan
        )


def _record_line(exchange: Exchange, line: bytes) -> None:
    """One SSE line of vLLM's streamed answer (the prompt IDs come in the first event)."""
    text = line.decode().strip()
    if text.startswith("data:") and text[5:].strip() != "[DONE]":
        _record(exchange, json.loads(text[5:]))


def _record(exchange: Exchange, payload: dict[str, Any]) -> None:
    """One JSON document of vLLM's answer: the whole reply, or one streamed event."""
    if exchange.reported_prompt is None and payload.get("prompt_token_ids") is not None:
        exchange.reported_prompt = list(payload["prompt_token_ids"])
        exchange.mm_placeholders = payload.get("mm_placeholders")
    for choice in payload.get("choices") or ():
        index = choice["index"]
        exchange.sampled.setdefault(index, []).extend(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or ()
        exchange.logprobs.setdefault(index, []).extend(entry["logprob"] for entry in content)
        for span in choice.get("weight_versions") or ():
            exchange.weight_versions.setdefault(index, []).append(
                (span["version"], span["start"], span["end"])
            )
