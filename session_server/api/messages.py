"""Anthropic Messages: `/sessions/{id}/v1/messages` and `/v1/messages`.

Claude Code and the Claude Agent SDK speak this API (always streaming). The front-end parses
the request into the internal `Conversation` and formats the core's `TurnResult` or stream
events back; it holds no splicing logic.

Mapping:
- `system` (string or text blocks) -> a leading system message; a `role: "system"` entry in
  `messages` (Claude Code sends its environment block that way) -> a system message there.
- text blocks -> content (blocks joined with "\\n"); `thinking` -> reasoning;
  `redacted_thinking` is opaque and dropped (the stored tokens hold what was sampled);
  `tool_use` -> a tool call (`input` as JSON text); each `tool_result` -> a `role: "tool"`
  message (`tool_call_id` = `tool_use_id`, its text blocks joined).
- `stop_sequences` -> `stop`; `max_tokens`, `temperature`, `top_p`, `top_k` keep their names.
- `tool_choice`: auto -> "auto", any -> "required", tool -> that function, none -> "none".
- Token-aware clients: per-message `prompt_token_ids` / `generation_token_ids` and a
  top-level `required_prefix_token_ids`; replies carry `prompt_token_ids` and `token_ids`
  when asked (`return_token_ids`, or the session's setting).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeInt

from session_server.api import turn_service
from session_server.api.errors import classify, error_body
from session_server.api.routing import LeanRoute, convert
from session_server.api.serving import IDEMPOTENCY_KEY_DOC, serve_turn
from session_server.api.session_ids import check_session_id, session_id_from_headers
from session_server.api.sse import event_line
from session_server.conversation import (
    Conversation,
    ConversationError,
    Message,
    Tool,
    ToolCall,
    text_chars,
)
from session_server.images import (
    ImageInput,
    check_count,
    compose,
    decode_base64,
    decode_data_url,
    no_marks,
)
from session_server.results import (
    ChoiceDelta,
    ChoiceFinished,
    ChoiceResult,
    StreamEvent,
    StreamFinished,
    StreamStarted,
    TurnResult,
)
from session_server.sampling import check_sampling

router = APIRouter(route_class=LeanRoute)

# --- wire request ------------------------------------------------------------------------


class _Wire(BaseModel):
    # Harnesses send fields tokenkeep has no use for (cache_control, citations,
    # context_management, output_config...); they are accepted and ignored.
    model_config = ConfigDict(extra="allow")


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Wire):
    type: Literal["redacted_thinking"]
    data: str = ""


class ImageSource(_Wire):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Wire):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _text_as_blocks(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[
        list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]],
        BeforeValidator(_text_as_blocks),
    ] = []
    is_error: bool = False


Block = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]
TokenIds = list[NonNegativeInt]


class WireMessage(_Wire):
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], BeforeValidator(_text_as_blocks)]
    prompt_token_ids: TokenIds | None = None
    generation_token_ids: TokenIds | None = None


class WireTool(_Wire):
    name: str = Field(min_length=1)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=dict)
    type: str | None = None
    defer_loading: bool = False


class WireToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class WireThinking(_Wire):
    type: str
    """`enabled` or `disabled` (`budget_tokens` and newer types are accepted, not read)."""


class CountTokensRequest(_Wire):
    model: str = ""
    messages: list[WireMessage] = Field(min_length=1)
    system: Annotated[list[TextBlock], BeforeValidator(_text_as_blocks)] = []
    tools: list[WireTool] = []
    tool_choice: WireToolChoice | None = None
    thinking: WireThinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] = []
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    required_prefix_token_ids: TokenIds | None = None
    return_token_ids: bool | None = None
    """vLLM's name: the reply carries `prompt_token_ids` and `token_ids` (default: the
    session's setting, else off for harness APIs, on for token-ID completions)."""


# --- request -> conversation -------------------------------------------------------------


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _image(block: ImageBlock, param: str) -> ImageInput:
    if block.source.type == "url":
        return decode_data_url(block.source.url or "", param=f"{param}.source.url")
    return decode_base64(block.source.data or "", param=f"{param}.source.data")


def _with_images(blocks: list[TextBlock | ImageBlock], param: str) -> Message:
    """Text blocks joined by newlines, an image where each image block is."""
    text, images = compose(
        [
            _image(block, f"{param}.{j}")
            if isinstance(block, ImageBlock)
            else no_marks(block.text, param)
            for j, block in enumerate(blocks)
        ],
        "\n",
    )
    return Message(role="user", content=text, images=images)


def conversation_from_request(request: CountTokensRequest) -> Conversation:
    messages: list[Message] = []
    if request.system:
        messages.append(Message(role="system", content=_joined(request.system)))
    for i, wire in enumerate(request.messages):
        if wire.role == "assistant":
            messages.append(_assistant_message(wire, i))
        else:
            messages.extend(_user_or_system_messages(wire, i))
    conversation = Conversation(
        messages=messages,
        tools=[_tool(t, i) for i, t in enumerate(request.tools) if not t.defer_loading],
        tool_choice=_tool_choice(request.tool_choice),
        api="messages",
        model=request.model or None,
        thinking={"enabled": True, "disabled": False}.get(request.thinking.type)
        if request.thinking
        else None,
    )
    if isinstance(request, MessagesRequest):
        conversation.stream = request.stream
        conversation.required_prefix_token_ids = request.required_prefix_token_ids
        conversation.return_token_ids = request.return_token_ids
        conversation.sampling = _sampling(request)
    return conversation


def _assistant_message(wire: WireMessage, i: int) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(wire.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(ToolCall(id=block.id, name=block.name, arguments=arguments))
        elif isinstance(block, ToolResultBlock | ImageBlock):
            raise ConversationError(
                f"{block.type} blocks belong in user messages", param=f"messages.{i}.content.{j}"
            )
    return Message(
        role="assistant",
        content="\n".join(texts),
        reasoning="\n".join(thoughts) if thoughts else None,
        tool_calls=calls,
        prompt_token_ids=wire.prompt_token_ids,
        generation_token_ids=wire.generation_token_ids,
    )


def _user_or_system_messages(wire: WireMessage, i: int) -> list[Message]:
    """A user turn's tool results become tool messages, in block order; its text blocks
    around them become user messages."""
    messages: list[Message] = []
    blocks: list[TextBlock | ImageBlock] = []
    param = f"messages.{i}.content"
    for j, block in enumerate(wire.content):
        if isinstance(block, TextBlock) or (isinstance(block, ImageBlock) and wire.role == "user"):
            blocks.append(block)
        elif isinstance(block, ToolResultBlock) and wire.role == "user":
            if blocks:
                messages.append(_with_images(blocks, param))
                blocks = []
            result = _with_images(block.content, f"{param}.{j}.content")
            result.role, result.tool_call_id = "tool", block.tool_use_id
            messages.append(result)
        else:
            raise ConversationError(
                f"{block.type} blocks are not allowed in {wire.role} messages",
                param=f"{param}.{j}",
            )
    if blocks or not messages:
        message = _with_images(blocks, param)
        message.role = wire.role
        messages.append(message)
    check_count(messages)
    return messages


def _tool(wire: WireTool, i: int) -> Tool:
    if wire.type not in (None, "custom"):
        raise ConversationError(
            f"server tool {wire.type!r} is not supported: tokenkeep serves client tools "
            "(name, description, input_schema) only",
            param=f"tools.{i}.type",
        )
    return Tool(name=wire.name, description=wire.description, parameters=wire.input_schema)


def _tool_choice(choice: WireToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ConversationError("tool_choice of type 'tool' needs a name", param="tool_choice")
        return {"name": choice.name}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _sampling(request: MessagesRequest) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": request.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(request, name)
        if value is not None:
            sampling[name] = value
    if request.stop_sequences:
        sampling["stop"] = list(request.stop_sequences)
    return check_sampling(sampling, names={"stop": "stop_sequences"})


# --- result -> wire response -------------------------------------------------------------


def message_id(result_id: str) -> str:
    return "msg_" + result_id


def thinking_signature(thinking: str) -> str:
    """Anthropic clients send thinking back with its signature; tokenkeep does not need it
    (the stored tokens hold what was sampled), so it is a stable digest, not a secret."""
    return (
        "tk1:"
        + hashlib.blake2b(thinking.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    )


def tool_input(call: ToolCall) -> dict[str, Any]:
    """`input` must be an object; sampled arguments that are not one become `{}` (the turn
    is stored as sampled either way)."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def anthropic_stop(choice: ChoiceResult) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a finished choice."""
    if choice.finish_reason == "tool_calls" or choice.message.tool_calls:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        # vLLM reports the matched stop string; a stop token id means a natural end.
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def content_blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning:
        blocks.append(
            {
                "type": "thinking",
                "thinking": message.reasoning,
                "signature": thinking_signature(message.reasoning),
            }
        )
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call)}
        )
    return blocks


def usage(result: TurnResult) -> dict[str, int]:
    return {
        "input_tokens": result.prompt_tokens,
        "output_tokens": result.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_response(result: TurnResult) -> dict[str, Any]:
    choice = result.choices[0]
    reason, sequence = anthropic_stop(choice)
    return {
        "id": message_id(result.response_id),
        "type": "message",
        "role": "assistant",
        "model": result.model,
        "content": content_blocks(choice.message),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(result),
    } | (
        {"prompt_token_ids": result.prompt_ids, "token_ids": choice.token_ids}
        if result.return_token_ids
        else {}
    )


def _event(data: dict[str, Any]) -> bytes:
    # Anthropic names every event after its payload's type.
    return event_line(data["type"], data)


def _block_event(kind: str, index: int, **fields: Any) -> bytes:
    return _event({"type": kind, "index": index, **fields})


async def message_stream(events: AsyncIterator[StreamEvent]) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: message_start, ping, per block content_block_start /
    content_block_delta / content_block_stop (thinking, then text, then each tool_use),
    message_delta (stop_reason, usage, token_ids), message_stop."""
    index = -1
    open_kind: str | None = None
    thinking = ""

    def open_block(kind: str) -> list[bytes]:
        nonlocal index, open_kind
        frames = close_block()
        index += 1
        open_kind = kind
        block = (
            {"type": "text", "text": ""}
            if kind == "text"
            else {"type": "thinking", "thinking": "", "signature": ""}
        )
        frames.append(_block_event("content_block_start", index, content_block=block))
        return frames

    def close_block() -> list[bytes]:
        nonlocal open_kind
        frames: list[bytes] = []
        if open_kind == "thinking":
            delta = {"type": "signature_delta", "signature": thinking_signature(thinking)}
            frames.append(_block_event("content_block_delta", index, delta=delta))
        if open_kind is not None:
            frames.append(_block_event("content_block_stop", index))
        open_kind = None
        return frames

    def text(kind: str, piece: str) -> list[bytes]:
        nonlocal thinking
        if not piece:
            return []
        frames = open_block(kind) if open_kind != kind else []
        if kind == "thinking":
            thinking += piece
            delta = {"type": "thinking_delta", "thinking": piece}
        else:
            delta = {"type": "text_delta", "text": piece}
        frames.append(_block_event("content_block_delta", index, delta=delta))
        return frames

    async for event in events:
        frames: list[bytes] = []
        if isinstance(event, StreamStarted):
            message = {
                "id": message_id(event.response_id),
                "type": "message",
                "role": "assistant",
                "model": event.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": len(event.prompt_ids),
                    "output_tokens": 0,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                },
            }
            if event.return_token_ids:
                message["prompt_token_ids"] = event.prompt_ids
            frames.append(_event({"type": "message_start", "message": message}))
            frames.append(_event({"type": "ping"}))
        elif isinstance(event, ChoiceDelta):
            frames += text("thinking", event.reasoning) + text("text", event.content)
        elif isinstance(event, ChoiceFinished):
            frames += text("thinking", event.reasoning_tail)
            frames += text("text", event.content_tail)
            frames += close_block()
            for call in event.message.tool_calls:
                index += 1
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                arguments = json.dumps(tool_input(call), ensure_ascii=False)
                frames.append(_block_event("content_block_start", index, content_block=block))
                frames.append(
                    _block_event(
                        "content_block_delta",
                        index,
                        delta={"type": "input_json_delta", "partial_json": arguments},
                    )
                )
                frames.append(_block_event("content_block_stop", index))
        elif isinstance(event, StreamFinished):
            choice = event.result.choices[0]
            reason, sequence = anthropic_stop(choice)
            delta_event = {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(event.result),
            }
            if event.result.return_token_ids:
                delta_event["token_ids"] = choice.token_ids
            frames.append(_event(delta_event))
            frames.append(_event({"type": "message_stop"}))
        for frame in frames:
            yield frame


# --- routes ------------------------------------------------------------------------------


async def _serve(session_id: str, wire: MessagesRequest, request: Request) -> Any:
    conversation = await convert(request, conversation_from_request, wire)
    service = turn_service(request)

    def on_error(exc: Exception) -> bytes:
        # The status line is gone: Anthropic reports a failure mid-stream as an event.
        status, message, param, kind = classify(exc)
        return event_line(
            "error", error_body(request.url.path, status, message, param=param, type=kind)
        )

    return await serve_turn(
        request,
        session_id,
        "messages",
        conversation,
        streaming=conversation.stream,
        complete=lambda: service.complete(session_id, conversation),
        stream=lambda: service.stream(session_id, conversation),
        reply=message_response,
        frames=message_stream,
        on_error=on_error,
    )


async def _count_tokens(session_id: str, wire: CountTokensRequest, request: Request) -> Any:
    """The prompt the conversation renders to by itself; a later turn that continues stored
    tokens can differ by the few tokens the bridge frames differently."""
    conversation = await convert(request, conversation_from_request, wire)
    service = turn_service(request)
    request.state.session_id = session_id
    request.state.api = "messages"
    service.planner.check_fits(text_chars(conversation), len(conversation.messages))
    prompt = service.model.render_prompt(conversation.messages, conversation.tools)
    return {"input_tokens": len(prompt)}


@router.post("/sessions/{session_id}/v1/messages", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def session_messages(session_id: str, body: MessagesRequest, request: Request) -> Any:
    return await _serve(check_session_id(session_id), body, request)


@router.post("/v1/messages", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def messages(body: MessagesRequest, request: Request) -> Any:
    return await _serve(session_id_from_headers(request), body, request)


@router.post("/sessions/{session_id}/v1/messages/count_tokens")
async def session_count_tokens(session_id: str, body: CountTokensRequest, request: Request) -> Any:
    return await _count_tokens(check_session_id(session_id), body, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
    return await _count_tokens(session_id_from_headers(request), body, request)
