"""OpenAI Chat Completions front-end: wire format <-> internal conversation. No splicing."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from session_server.api import turn_service
from session_server.api.params import TemplateKwargs, explicit_sampling
from session_server.api.replies import tokenkeep_info, usage
from session_server.api.routing import LeanRoute, convert
from session_server.api.serving import IDEMPOTENCY_KEY_DOC, serve_turn
from session_server.api.session_ids import check_session_id, session_id_from_headers
from session_server.api.sse import DONE, data_line, openai_error_line
from session_server.conversation import (
    Conversation,
    ConversationError,
    Message,
    Tool,
    ToolCall,
)
from session_server.images import ImageInput, check_count, compose, decode_data_url, no_marks
from session_server.results import (
    ChoiceDelta,
    ChoiceFinished,
    ChoiceResult,
    StreamFinished,
    StreamStarted,
    TurnResult,
)

router = APIRouter(route_class=LeanRoute)


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    reasoning_ended: bool | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    """vLLM's: variables the chat template renders with (`enable_thinking`), over the
    session's default key by key."""
    required_prefix_token_ids: list[int] | None = None
    return_token_ids: bool | None = None
    """vLLM's name: the reply carries `prompt_token_ids` and `token_ids` (default: the
    session's setting, else off for harness APIs, on for token-ID completions)."""


def _content(
    content: str | list[ContentPart] | None, role: str, index: int
) -> tuple[str, list[ImageInput]]:
    """The text (an `IMAGE_MARK` where each image is) and the images of a message."""
    if content is None:
        return "", []
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return no_marks(content, param), []
    pieces: list[str | ImageInput] = []
    for i, part in enumerate(content):
        if part.type == "image_url":
            if role not in ("user", "tool"):
                raise ConversationError(
                    f"images are accepted in user and tool messages, not {role}", param=param
                )
            source = getattr(part, "image_url", None)
            url = source.get("url") if isinstance(source, dict) else source
            if not isinstance(url, str):
                raise ConversationError("image_url needs a url", param=f"{param}[{i}]")
            pieces.append(decode_data_url(url, param=f"{param}[{i}].image_url"))
        elif part.type in ("text", "input_text", "output_text"):
            pieces.append(no_marks(part.text or "", param))
        else:
            raise ConversationError(
                f"content part type {part.type!r} is not supported (text and image_url)",
                param=param,
            )
    return compose(pieces, "")


def _arguments(value: str | dict[str, Any]) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def to_conversation(body: ChatCompletionRequest) -> Conversation:
    if body.top_logprobs:
        # The engine is asked for the sampled token's logprob only; answering `[]` where
        # alternatives were asked for would look like a model that had none.
        raise ConversationError(
            "top_logprobs > 0 is not supported: logprobs: true returns the sampled tokens' "
            "logprobs, without alternatives",
            param="top_logprobs",
        )
    messages: list[Message] = []
    for index, m in enumerate(body.messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        text, images = _content(m.content, role, index)
        messages.append(
            Message(
                role=role,  # type: ignore[arg-type]
                content=text,
                images=images,
                reasoning=m.reasoning_content or m.reasoning,
                tool_calls=[
                    ToolCall(
                        id=c.id, name=c.function.name, arguments=_arguments(c.function.arguments)
                    )
                    for c in m.tool_calls or []
                ],
                tool_call_id=m.tool_call_id,
                name=m.name,
                prompt_token_ids=m.prompt_token_ids,
                generation_token_ids=m.generation_token_ids,
            )
        )
    check_count(messages)
    sampling = explicit_sampling(
        body,
        body.max_completion_tokens or body.max_tokens,
        max_tokens_name="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
    )
    return Conversation(
        messages=messages,
        tools=[
            Tool(
                name=t.function.name,
                description=t.function.description or "",
                parameters=t.function.parameters or {},
            )
            for t in body.tools or []
        ],
        tool_choice=_tool_choice(body.tool_choice),
        sampling=sampling,
        n=body.n,
        logprobs=body.logprobs,
        response_format=body.structured_outputs or _structured(body.response_format),
        stream=body.stream,
        api="chat",
        model=body.model,
        required_prefix_token_ids=body.required_prefix_token_ids,
        reasoning_ended=body.reasoning_ended,
        template_kwargs=body.chat_template_kwargs or {},
        return_token_ids=body.return_token_ids,
    )


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`{"type": "function", "function": {"name": ...}}` -> the core's `{"name": ...}`."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if not isinstance(name, str) or not name:
            raise ConversationError("tool_choice needs a function name", param="tool_choice")
        return {"name": name}
    return choice


def _structured(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI `response_format` as a vLLM structured-output constraint."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ConversationError(
                "response_format.json_schema.schema must be an object", param="response_format"
            )
        return {"json": schema}
    raise ConversationError(f"unknown response_format type {kind!r}", param="response_format")


# --- responses ---------------------------------------------------------------------------


def _message_out(choice: ChoiceResult) -> dict[str, Any]:
    m = choice.message
    out: dict[str, Any] = {"role": "assistant", "content": m.content or None}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [_tool_call_out(c) for c in m.tool_calls]
    return out


def _tool_call_out(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out["index"] = index
    return out


def _logprobs_out(model: Any, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    entries = []
    for token, lp in zip(token_ids, logprobs, strict=False):
        text = model.decode([token])
        entries.append(
            {
                "token": text,
                "logprob": None if lp is None or math.isnan(lp) else lp,
                "bytes": list(text.encode("utf-8", "surrogatepass")),
                "top_logprobs": [],
            }
        )
    return {"content": entries}


def _completion_id(response_id: str) -> str:
    return "chatcmpl-" + response_id


def format_result(result: TurnResult, conversation: Conversation, model: Any) -> dict[str, Any]:
    choices = []
    for c in result.choices:
        choice: dict[str, Any] = {
            "index": c.index,
            "message": _message_out(c),
            "finish_reason": c.finish_reason,
            "logprobs": _logprobs_out(model, c.token_ids, c.logprobs)
            if conversation.logprobs
            else None,
        }
        if result.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    body = {
        "id": _completion_id(result.response_id),
        "object": "chat.completion",
        "created": result.created,
        "model": result.model,
        "choices": choices,
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
    token_ids = False

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return data_line({**head, "choices": choices, **extra})

    async for event in events:
        if isinstance(event, StreamStarted):
            token_ids = event.return_token_ids
            head = {
                "id": _completion_id(event.response_id),
                "object": "chat.completion.chunk",
                "created": event.created,
                "model": event.model,
            }
            for i in range(event.n):
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **({"prompt_token_ids": event.prompt_ids} if i == 0 and token_ids else {}),
                    tokenkeep=tokenkeep_info(event),
                )
        elif isinstance(event, ChoiceDelta):
            delta: dict[str, Any] = {}
            if event.reasoning:
                delta["reasoning_content"] = event.reasoning
            if event.content:
                delta["content"] = event.content
            out: dict[str, Any] = {
                "index": event.index,
                "delta": delta,
                "logprobs": _logprobs_out(model, event.token_ids, event.logprobs)
                if conversation.logprobs
                else None,
                "finish_reason": None,
            }
            if token_ids:
                out["token_ids"] = event.token_ids
            yield chunk([out])
        elif isinstance(event, ChoiceFinished):
            delta = {}
            if event.reasoning_tail:
                delta["reasoning_content"] = event.reasoning_tail
            if event.content_tail:
                delta["content"] = event.content_tail
            if event.message.tool_calls:
                delta["tool_calls"] = [
                    _tool_call_out(c, k) for k, c in enumerate(event.message.tool_calls)
                ]
            if delta:
                yield chunk(
                    [
                        {
                            "index": event.index,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            yield chunk(
                [
                    {
                        "index": event.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": event.finish_reason,
                    }
                ]
            )
        elif isinstance(event, StreamFinished):
            result = event.result
            if include_usage:
                yield chunk([], usage=usage(result), tokenkeep=tokenkeep_info(result))
    yield DONE


async def _serve(session_id: str, body: ChatCompletionRequest, request: Request) -> Any:
    service = turn_service(request)
    conversation = await convert(request, to_conversation, body)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve_turn(
        request,
        session_id,
        "chat",
        conversation,
        streaming=conversation.stream,
        complete=lambda: service.complete(session_id, conversation),
        stream=lambda: service.stream(session_id, conversation),
        reply=lambda result: format_result(result, conversation, service.model),
        frames=lambda events: _chunks(events, conversation, service.model, include_usage),
        on_error=openai_error_line(request.url.path),
    )


@router.post("/sessions/{session_id}/v1/chat/completions", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def session_chat_completions(
    session_id: str, body: ChatCompletionRequest, request: Request
) -> Any:
    return await _serve(check_session_id(session_id), body, request)


@router.post("/v1/chat/completions", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    return await _serve(session_id_from_headers(request), body, request)


def models_payload(model_name: str, context_length: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "tokenkeep",
                "max_model_len": context_length,
            }
        ],
    }


@router.get("/sessions/{session_id}/v1/models")
async def session_models(session_id: str, request: Request) -> dict[str, Any]:
    check_session_id(session_id)
    config = turn_service(request).config
    return models_payload(config.model_name, config.context_length)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    config = turn_service(request).config
    return models_payload(config.model_name, config.context_length)
