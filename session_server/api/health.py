"""Health, readiness, metrics, and tokenizer utilities."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from session_server import images
from session_server.api import turn_service
from session_server.api.chat import (
    ChatCompletionRequest,
    ChatMessageIn,
    ToolDef,
    to_conversation,
)
from session_server.api.errors import APIError
from session_server.conversation import text_chars

router = APIRouter()
STORE_MEMORY_TIMEOUT_S = 1.0
"""How long a scrape waits for Redis's INFO memory (a slow Redis must not stall /metrics)."""


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request, engine: bool = False) -> Response:
    """Ready when the store answers and the server is not draining. A ready engine is not
    required (`?engine=true` asks for one too): while every engine replica restarts or
    loads, sessions are still created, finished, exported and viewed, and turns get a
    retryable 503 in their API's shape, so the session API stays behind its Service."""
    service = turn_service(request)
    draining = request.app.state.admission.draining
    store_ok = await service.store.ping()
    engine_ok = await service.engine.ready()
    ok = store_ok and not draining and (engine_ok or not engine)
    body = {
        "status": "ready" if ok else "not ready",
        "store": store_ok,
        "engine": engine_ok,
        "draining": draining,
        # Replicas that get no turns, and why (the policy's fencing, a tokenizer that differs
        # from this server's): the session API stays ready, their turns are refused.
        "refused": {
            replica.url: replica.refused
            for replica in service.engine.replicas
            if replica.refused is not None
        },
    }
    return Response(json.dumps(body), status_code=200 if ok else 503, media_type="application/json")


async def store_memory(request: Request) -> dict[str, int | None] | None:
    """The store's memory as Redis reports it (None: a store without a memory bound, like the
    embedded one): used and max bytes (None where Redis did not answer in time; max 0:
    unbounded), and the writes refused because it was full. Recorded in the metrics too."""
    service = turn_service(request)
    store = service.store
    memory = getattr(store, "memory", None)  # Redis: INFO memory; the embedded store: none
    if memory is None:
        return None
    try:
        used = await asyncio.wait_for(memory(), STORE_MEMORY_TIMEOUT_S)
    except TimeoutError:
        used = None
    refusals = getattr(store, "full_refusals", 0)
    service.metrics.record_store_memory(used, refusals)
    return {
        "used_bytes": None if used is None else used[0],
        "max_bytes": None if used is None else used[1],
        "full_refusals": refusals,
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    service = turn_service(request)
    await store_memory(request)
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    service = turn_service(request)
    model = service.model
    if body.prompt is not None:
        service.planner.check_fits(len(body.prompt), param="prompt")
        tokens = list(
            model.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        )
    else:
        conversation = to_conversation(
            ChatCompletionRequest(messages=body.messages or [], tools=body.tools)
        )
        service.planner.check_fits(text_chars(conversation), len(conversation.messages))
        await images.admit(conversation.messages, model.vision is not None)
        tokens = model.render_prompt(conversation.messages, conversation.tools)
    config = service.config
    return {"count": len(tokens), "max_model_len": config.context_length, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    model = turn_service(request).model
    bad = [t for t in body.tokens if t < 0 or t >= model.vocab_size]
    if bad:
        raise APIError(400, f"token ids out of vocabulary: {bad[:5]}", param="tokens")
    return {"prompt": model.decode(body.tokens)}
