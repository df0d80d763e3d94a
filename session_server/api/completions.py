"""OpenAI (legacy) Completions front-end, for clients that send the token prompt themselves.

A token-ID prompt is matched against the session's stored tokens (`TurnService.plan_tokens`):
the deepest turn whose prompt + sampled tokens it starts with is its parent, and only what
follows is new context. A text prompt is tokenized as given (no chat template). One prompt
per request: a session is one conversation.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from session_server.api import turn_service
from session_server.api.params import explicit_sampling
from session_server.api.replies import tokenkeep_info, usage
from session_server.api.routing import LeanRoute
from session_server.api.serving import IDEMPOTENCY_KEY_DOC, serve_turn
from session_server.api.session_ids import check_session_id, session_id_from_headers
from session_server.api.sse import DONE, data_line, openai_error_line
from session_server.conversation import Conversation, ConversationError
from session_server.results import (
    ChoiceDelta,
    ChoiceFinished,
    StreamFinished,
    StreamStarted,
    TurnResult,
)

router = APIRouter(route_class=LeanRoute)

_REPLACEMENT = "\ufffd"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    structured_outputs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    """vLLM's name: the reply carries `prompt_token_ids` and `token_ids` (default: the
    session's setting, else off for harness APIs, on for token-ID completions)."""


def prompt_ids(body: CompletionRequest, model: Any) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return model.encode(prompt)
    if not prompt:
        raise ConversationError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if len(prompt) != 1:
        raise ConversationError(
            "one prompt per request: a session is one conversation", param="prompt"
        )
    only = prompt[0]
    return model.encode(only) if isinstance(only, str) else list(only)


def to_conversation(body: CompletionRequest) -> Conversation:
    if body.echo:
        raise ConversationError("echo is not supported", param="echo")
    sampling = explicit_sampling(body, body.max_tokens)
    return Conversation(
        messages=[],
        sampling=sampling,
        n=body.n,
        logprobs=body.logprobs is not None,
        response_format=body.structured_outputs,
        stream=body.stream,
        api="completions",
        model=body.model,
        return_token_ids=body.return_token_ids,
    )


def _text(model: Any, token_ids: list[int]) -> str:
    stops = set(model.stop_token_ids)
    while token_ids and token_ids[-1] in stops:
        token_ids = token_ids[:-1]
    return model.tokenizer.decode(token_ids, skip_special_tokens=True)


def _logprobs(model: Any, token_ids: list[int], values: list[float], offset: int) -> dict[str, Any]:
    tokens = [model.decode([t]) for t in token_ids]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if math.isnan(v) else v for v in values],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def format_result(result: TurnResult, conversation: Conversation, model: Any) -> dict[str, Any]:
    body = {
        "id": "cmpl-" + result.response_id,
        "object": "text_completion",
        "created": result.created,
        "model": result.model,
        "choices": [
            {
                "index": c.index,
                "text": _text(model, c.token_ids),
                "logprobs": _logprobs(model, c.token_ids, c.logprobs, 0)
                if conversation.logprobs
                else None,
                "finish_reason": "length" if c.finish_reason == "length" else "stop",
                "stop_reason": c.stop_reason,
            }
            | ({"token_ids": c.token_ids} if result.return_token_ids else {})
            for c in result.choices
        ],
        "usage": usage(result),
        "tokenkeep": tokenkeep_info(result),
    }
    if result.return_token_ids:
        body["prompt_token_ids"] = result.prompt_ids
    return body


async def _chunks(
    events: AsyncIterator[Any], conversation: Conversation, model: Any, include_usage: bool
) -> AsyncIterator[bytes]:
    head: dict[str, Any] = {}
    pending: dict[int, list[int]] = {}
    stops = set(model.stop_token_ids)
    token_ids = False
    async for event in events:
        if isinstance(event, StreamStarted):
            token_ids = event.return_token_ids
            head = {
                "id": "cmpl-" + event.response_id,
                "object": "text_completion",
                "created": event.created,
                "model": event.model,
            }
            yield data_line(
                {
                    **head,
                    "choices": [],
                    **({"prompt_token_ids": event.prompt_ids} if token_ids else {}),
                    "tokenkeep": tokenkeep_info(event),
                }
            )
        elif isinstance(event, ChoiceDelta):
            held = pending.setdefault(event.index, [])
            held.extend(t for t in event.token_ids if t not in stops)
            text = model.tokenizer.decode(held, skip_special_tokens=True)
            if text.endswith(_REPLACEMENT):
                text = ""  # the rest of the character is in a later token
            else:
                held.clear()
            yield data_line(
                {
                    **head,
                    "choices": [
                        {
                            "index": event.index,
                            "text": text,
                            "finish_reason": None,
                            "logprobs": _logprobs(model, event.token_ids, event.logprobs, 0)
                            if conversation.logprobs
                            else None,
                        }
                        | ({"token_ids": event.token_ids} if token_ids else {})
                    ],
                }
            )
        elif isinstance(event, ChoiceFinished):
            rest = model.tokenizer.decode(pending.pop(event.index, []), skip_special_tokens=True)
            yield data_line(
                {
                    **head,
                    "choices": [
                        {
                            "index": event.index,
                            "text": rest,
                            "logprobs": None,
                            "finish_reason": "length"
                            if event.finish_reason == "length"
                            else "stop",
                        }
                    ],
                }
            )
        elif isinstance(event, StreamFinished) and include_usage:
            yield data_line({**head, "choices": [], "usage": usage(event.result)})
    yield DONE


async def _serve(session_id: str, body: CompletionRequest, request: Request) -> Any:
    service = turn_service(request)
    conversation = to_conversation(body)
    ids = prompt_ids(body, service.model)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve_turn(
        request,
        session_id,
        "completions",
        conversation,
        streaming=conversation.stream,
        complete=lambda: service.complete_tokens(session_id, ids, conversation),
        stream=lambda: service.stream_tokens(session_id, ids, conversation),
        reply=lambda result: format_result(result, conversation, service.model),
        frames=lambda events: _chunks(events, conversation, service.model, include_usage),
        on_error=openai_error_line(request.url.path),
    )


@router.post("/sessions/{session_id}/v1/completions", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def session_completions(session_id: str, body: CompletionRequest, request: Request) -> Any:
    return await _serve(check_session_id(session_id), body, request)


@router.post("/v1/completions", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def completions(body: CompletionRequest, request: Request) -> Any:
    return await _serve(session_id_from_headers(request), body, request)
