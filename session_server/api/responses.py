"""OpenAI Responses: `/sessions/{id}/v1/responses` and `/v1/responses`.

Codex and the OpenAI Agents SDK speak this API. The front-end parses the request into the
internal `Conversation` and formats the core's `TurnResult` or stream events back; it holds
no splicing logic.

Mapping:
- `input` string -> one user message; items: `message` (user, system, developer -> system,
  assistant; text parts joined with "\\n"), `reasoning` (its reasoning_text, else its
  summary) + assistant `message` + `function_call` items in a row -> one assistant message
  with reasoning, content and tool calls; `function_call_output` -> a `role: "tool"`
  message. `instructions` -> a leading system message.
- `previous_response_id` -> `Conversation.previous_response_id` (the core's raw response
  id: the `resp_` prefix is stripped); the messages are then only the new items, without
  `instructions` (the continued turn's stored prompt holds the ones it was sampled with).
- `max_output_tokens` -> `max_tokens`; `temperature`, `top_p` keep their names;
  `text.format` json_schema / json_object -> a structured-output constraint.
- Output: a `reasoning` item (reasoning_text content), a `message` item (one output_text
  part), one `function_call` item per tool call; plus `prompt_token_ids` and `token_ids`
  when asked (`return_token_ids`, or the session's setting).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeInt,
    Tag,
)

from session_server.api import turn_service
from session_server.api.errors import classify
from session_server.api.response_tools import (
    ToolMap,
    call_from_item,
    open_reasoning,
    seal_reasoning,
)
from session_server.api.routing import LeanRoute, convert
from session_server.api.serving import IDEMPOTENCY_KEY_DOC, serve_turn
from session_server.api.session_ids import check_session_id, session_id_from_headers
from session_server.api.sse import event_line
from session_server.conversation import Conversation, ConversationError, Message, ToolCall
from session_server.images import ImageInput, check_count, compose, decode_data_url, no_marks
from session_server.results import (
    ChoiceDelta,
    ChoiceFinished,
    StreamEvent,
    StreamFinished,
    StreamStarted,
    TurnResult,
)
from session_server.sampling import check_sampling

router = APIRouter(route_class=LeanRoute)

RESPONSE_ID_PREFIX = "resp_"

# --- wire request ------------------------------------------------------------------------


class _Wire(BaseModel):
    # Clients send fields tokenkeep has no use for (include, truncation, reasoning effort,
    # prompt_cache_key, item ids and statuses...); they are accepted and ignored.
    model_config = ConfigDict(extra="allow")


class TextPart(_Wire):
    type: Literal["input_text", "output_text"]
    text: str


class ImagePart(_Wire):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _text_as_parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


TokenIds = list[NonNegativeInt]


class _AssistantTokens(_Wire):
    prompt_token_ids: TokenIds | None = None
    generation_token_ids: TokenIds | None = None


class MessageItem(_AssistantTokens):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[list[Part], BeforeValidator(_text_as_parts)]


class ReasoningText(_Wire):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_AssistantTokens):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class FunctionCallItem(_AssistantTokens):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class CustomToolCallItem(_AssistantTokens):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class LocalShellCallItem(_AssistantTokens):
    type: Literal["local_shell_call"]
    call_id: str | None = None
    id: str | None = None
    action: dict[str, Any] = {}


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output", "custom_tool_call_output", "local_shell_call_output"]
    call_id: str
    output: Annotated[list[Part], BeforeValidator(_text_as_parts)]


class HostedCallItem(_Wire):
    """A call a hosted tool made on OpenAI's servers (web search...): nothing was sampled
    here for it, so it is no part of the token history."""

    type: str


_HOSTED_CALLS = {
    "web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call",
    "computer_call", "computer_call_output", "mcp_call", "mcp_list_tools", "tool_search_call",
    "tool_search_output",
}  # fmt: skip


def _item_type(value: Any) -> str | None:
    # Easy input messages (`{"role": ..., "content": ...}`) carry no type.
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return "hosted" if kind in _HOSTED_CALLS else kind


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[LocalShellCallItem, Tag("local_shell_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[FunctionCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[FunctionCallOutputItem, Tag("local_shell_call_output")]
    | Annotated[HostedCallItem, Tag("hosted")],
    Discriminator(_item_type),
]


def _text_as_input(value: Any) -> Any:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class FunctionTool(_Wire):
    """Any Responses tool; `response_tools.ToolMap` decides what the model is offered."""

    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionChoice(_Wire):
    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextConfig(_Wire):
    format: TextFormat | None = None


class ResponsesRequest(_Wire):
    model: str = ""
    input: Annotated[list[Item], BeforeValidator(_text_as_input)] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] = []
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    background: bool = False
    include: list[str] = []
    top_logprobs: int | None = None
    required_prefix_token_ids: TokenIds | None = None
    return_token_ids: bool | None = None
    """vLLM's name: the reply carries `prompt_token_ids` and `token_ids` (default: the
    session's setting, else off for harness APIs, on for token-ID completions)."""


# --- request -> conversation -------------------------------------------------------------


def conversation_from_request(
    request: ResponsesRequest, *, reasoning: ReasoningOpener | None = None
) -> Conversation:
    """`reasoning` reads the sealed `encrypted_content` of resent reasoning items."""
    if request.background:
        raise ConversationError("background responses are not supported", param="background")
    if request.top_logprobs or "message.output_text.logprobs" in request.include:
        # An output_text part does not map onto the sampled tokens (reasoning and tool calls
        # are sampled too); an empty list would read as "no logprobs". The exact values are
        # in Chat Completions (`logprobs: true`) and in the trajectory export.
        raise ConversationError(
            "output_text logprobs are not supported on /v1/responses: use Chat Completions "
            "with logprobs: true, or the session's trajectory export",
            param="top_logprobs" if request.top_logprobs else "include",
        )
    messages: list[Message] = []
    # A continued response's stored prompt already holds the instructions it was sampled
    # with (clients resend them on every call); only the new items are appended to it.
    if request.instructions and not request.previous_response_id:
        messages.append(Message(role="system", content=request.instructions))
    messages += messages_from_items(request.input, reasoning)
    check_count(messages)
    tools = tool_map(request)
    return Conversation(
        messages=messages,
        tools=tools.tools,
        tool_choice=_tool_choice(request.tool_choice, tools),
        sampling=_sampling(request),
        response_format=_response_format(request.text),
        stream=request.stream,
        api="responses",
        model=request.model or None,
        required_prefix_token_ids=request.required_prefix_token_ids,
        return_token_ids=request.return_token_ids,
        previous_response_id=(
            request.previous_response_id.removeprefix(RESPONSE_ID_PREFIX)
            if request.previous_response_id
            else None
        ),
    )


# An assistant turn comes back as reasoning, then a message, then function calls (the order
# tokenkeep emits them in); an item that cannot follow the previous one starts a new turn.
_RANK = {
    ReasoningItem: 0, MessageItem: 1, FunctionCallItem: 2, CustomToolCallItem: 2,
    LocalShellCallItem: 2,
}  # fmt: skip
ReasoningOpener = Callable[[str | None], str | None]


def messages_from_items(
    items: list[Any], reasoning: ReasoningOpener | None = None
) -> list[Message]:
    messages: list[Message] = []
    turn: Message | None = None
    rank = -1
    for item in items:
        if isinstance(item, HostedCallItem):
            continue
        assistant = isinstance(
            item, ReasoningItem | FunctionCallItem | CustomToolCallItem | LocalShellCallItem
        ) or (isinstance(item, MessageItem) and item.role == "assistant")
        if not assistant:
            turn = None
            messages.append(_non_assistant_message(item))
            continue
        item_rank = _RANK[type(item)]
        if turn is None or item_rank < rank or (item_rank == rank and item_rank != 2):
            turn = Message(role="assistant")
            messages.append(turn)
        rank = item_rank
        _add_to_turn(turn, item, reasoning)
    return messages


def _non_assistant_message(item: MessageItem | FunctionCallOutputItem) -> Message:
    tool = isinstance(item, FunctionCallOutputItem)
    role = "tool" if tool else ("system" if item.role == "developer" else item.role)
    text, images = compose(
        [
            _image(part, role) if isinstance(part, ImagePart) else no_marks(part.text, "input")
            for part in (item.output if isinstance(item, FunctionCallOutputItem) else item.content)
        ],
        "\n",
    )
    if isinstance(item, FunctionCallOutputItem):
        return Message(role="tool", content=text, images=images, tool_call_id=item.call_id)
    return Message(role=role, content=text, images=images)  # type: ignore[arg-type]


def _image(part: ImagePart, role: str) -> ImageInput:
    if role not in ("user", "tool"):
        raise ConversationError(f"input_image belongs in user input, not {role}", param="input")
    if part.image_url is None:
        raise ConversationError(
            "input_image needs an image_url (a data: URL); file_id is not supported",
            param="input",
        )
    return decode_data_url(part.image_url, param="input")


def _add_to_turn(turn: Message, item: Any, reasoning: ReasoningOpener | None) -> None:
    if isinstance(item, ReasoningItem):
        # Codex sends reasoning back without its text, only the sealed value it was given.
        sealed = reasoning(item.encrypted_content) if reasoning else None
        parts = item.content if item.content else item.summary
        turn.reasoning = sealed if sealed is not None else "\n".join(p.text for p in parts)
    elif isinstance(item, MessageItem):
        if any(isinstance(part, ImagePart) for part in item.content):
            raise ConversationError("assistant messages cannot hold images", param="input")
        turn.content = "\n".join(part.text for part in item.content if isinstance(part, TextPart))
    else:
        turn.tool_calls.append(call_from_item(item))
    turn.prompt_token_ids = turn.prompt_token_ids or item.prompt_token_ids
    turn.generation_token_ids = turn.generation_token_ids or item.generation_token_ids


def tool_map(request: ResponsesRequest) -> ToolMap:
    return ToolMap([tool.model_dump(exclude_none=True) for tool in request.tools])


def _tool_choice(
    choice: str | FunctionChoice | None, tools: ToolMap
) -> str | dict[str, Any] | None:
    if isinstance(choice, FunctionChoice):
        return {"name": tools.choice(choice.type, choice.name, choice.namespace)}
    return choice


def _sampling(request: ResponsesRequest) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    if request.max_output_tokens is not None:
        sampling["max_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p"):
        value = getattr(request, name)
        if value is not None:
            sampling[name] = value
    return check_sampling(sampling, names={"max_tokens": "max_output_tokens"})


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    if text is None or text.format is None or text.format.type == "text":
        return None
    if text.format.type == "json_object":
        return {"json_object": True}
    if text.format.schema_ is None:
        raise ConversationError("json_schema format needs a schema", param="text.format.schema")
    return {"json": text.format.schema_}


# --- result -> wire response -------------------------------------------------------------


def response_id(result_id: str) -> str:
    return RESPONSE_ID_PREFIX + result_id


def reasoning_item(
    result_id: str, reasoning: str, seal: ReasoningSealer | None = None
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": "rs_" + result_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": reasoning}],
        "status": "completed",
    }
    if seal is not None:
        item["encrypted_content"] = seal(result_id, reasoning)
    return item


def message_item(result_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": "msg_" + result_id,
        "role": "assistant",
        "status": status,
        "content": content if status == "completed" else [],
    }


ReasoningSealer = Callable[[str, str], str]
"""(response id, reasoning text) -> the reasoning item's `encrypted_content`."""


def output_items(
    result_id: str, message: Message, tools: ToolMap, seal: ReasoningSealer | None = None
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.reasoning:
        items.append(reasoning_item(result_id, message.reasoning, seal))
    if message.content or not message.tool_calls:
        items.append(message_item(result_id, message.content))
    items += [tools.output_item(call) for call in message.tool_calls]
    return items


def response_object(
    request: ResponsesRequest,
    *,
    result_id: str,
    created: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    result: TurnResult | None = None,
) -> dict[str, Any]:
    """The Response, echoing the request's settings as the real API does."""
    text_format = (
        request.text.format.model_dump(by_alias=True, exclude_none=True)
        if (request.text and request.text.format)
        else {"type": "text"}
    )
    body: dict[str, Any] = {
        "id": response_id(result_id),
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": request.temperature,
        "text": {"format": text_format},
        "tool_choice": request.tool_choice.model_dump()
        if isinstance(request.tool_choice, FunctionChoice)
        else request.tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools],
        "top_p": request.top_p,
        "truncation": "disabled",
        "metadata": request.metadata or {},
        "usage": None,
    }
    if result is not None:
        choice = result.choices[0]
        body["usage"] = {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }
        if result.return_token_ids:
            body["prompt_token_ids"] = result.prompt_ids
            body["token_ids"] = choice.token_ids
    return body


def final_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_from_result(
    request: ResponsesRequest, result: TurnResult, seal: ReasoningSealer | None = None
) -> dict[str, Any]:
    choice = result.choices[0]
    return response_object(
        request,
        result_id=result.response_id,
        created=result.created,
        model=result.model,
        status=final_status(choice.finish_reason),
        output=output_items(result.response_id, choice.message, tool_map(request), seal),
        result=result,
    )


class ResponseStream:
    """The Responses event sequence: response.created, response.in_progress; per output
    item output_item.added, (content_part.added, *_text.delta..., *_text.done,
    content_part.done | function_call_arguments.delta, .done), output_item.done; then
    response.completed (or response.incomplete when max_output_tokens cut it short).
    Every event carries the next `sequence_number`, the `error` event for a failure after
    the start included."""

    def __init__(self, request: ResponsesRequest, seal: ReasoningSealer | None = None) -> None:
        self.request = request
        self.tools = tool_map(request)
        self.seal = seal
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open_kind: str | None = None
        self.open_text = ""
        self.result_id = ""

    async def frames(self, events: AsyncIterator[StreamEvent]) -> AsyncIterator[bytes]:
        async for event in events:
            for frame in self._frames(event):
                yield frame

    def error(self, exc: Exception) -> bytes:
        status, message, param, kind = classify(exc)
        return self._frame("error", code=kind or str(status), message=message, param=param)

    def _frames(self, event: StreamEvent) -> list[bytes]:
        frames: list[bytes] = []
        if isinstance(event, StreamStarted):
            self.result_id = event.response_id
            response = response_object(
                self.request,
                result_id=event.response_id,
                created=event.created,
                model=event.model,
                status="in_progress",
                output=[],
            )
            if event.return_token_ids:
                response["prompt_token_ids"] = event.prompt_ids
            frames.append(self._frame("response.created", response=response))
            frames.append(self._frame("response.in_progress", response=response))
        elif isinstance(event, ChoiceDelta):
            frames += self._text("reasoning", event.reasoning)
            frames += self._text("message", event.content)
        elif isinstance(event, ChoiceFinished):
            frames += self._text("reasoning", event.reasoning_tail)
            frames += self._text("message", event.content_tail)
            has_message = any(item["type"] == "message" for item in self.output)
            if not event.message.tool_calls and not has_message and self.open_kind != "message":
                frames += self._open("message")  # an empty reply is still a message
            frames += self._close()
            for call in event.message.tool_calls:
                frames += self._function_call(call)
        elif isinstance(event, StreamFinished):
            final = response_from_result(self.request, event.result, self.seal)
            kind = (
                "response.completed" if final["status"] == "completed" else ("response.incomplete")
            )
            frames.append(self._frame(kind, response=final))
        return frames

    def _frame(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        return event_line(kind, {"type": kind, "sequence_number": self.sequence - 1, **fields})

    def _open(self, kind: str) -> list[bytes]:
        frames = self._close()
        self.open_kind, self.open_text = kind, ""
        if kind == "reasoning":
            item = {**reasoning_item(self.result_id, ""), "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = message_item(self.result_id, "", status="in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        position = {"output_index": len(self.output) - 1}
        frames.append(self._frame("response.output_item.added", item=item, **position))
        frames.append(
            self._frame(
                "response.content_part.added",
                item_id=item["id"],
                content_index=0,
                part=part,
                **position,
            )
        )
        return frames

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        if self.open_kind == "reasoning":
            item = reasoning_item(self.result_id, self.open_text, self.seal)
            text_event = "reasoning_text"
            extra: dict[str, Any] = {}
        else:
            item, text_event = message_item(self.result_id, self.open_text), "output_text"
            extra = {"logprobs": []}
        self.open_kind = None
        self.output[-1] = item
        index = len(self.output) - 1
        position = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._frame(f"response.{text_event}.done", text=self.open_text, **position, **extra),
            self._frame("response.content_part.done", part=item["content"][0], **position),
            self._frame("response.output_item.done", item=item, output_index=index),
        ]

    def _text(self, kind: str, piece: str) -> list[bytes]:
        if not piece:
            return []
        frames = self._open(kind) if self.open_kind != kind else []
        self.open_text += piece
        event = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {"logprobs": []} if kind == "message" else {}
        frames.append(
            self._frame(
                f"response.{event}.delta",
                item_id=self.output[-1]["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=piece,
                **extra,
            )
        )
        return frames

    def _function_call(self, call: ToolCall) -> list[bytes]:
        self.output.append(self.tools.output_item(call, status="in_progress"))
        index = len(self.output) - 1
        added = self.output[index]
        item_id = added["id"]
        position = {"item_id": item_id, "output_index": index}
        frames = [self._frame("response.output_item.added", item=added, output_index=index)]
        self.output[index] = done = self.tools.output_item(call)
        if added["type"] == "function_call":
            frames += [
                self._frame(
                    "response.function_call_arguments.delta", delta=call.arguments, **position
                ),
                self._frame(
                    "response.function_call_arguments.done",
                    name=added["name"],
                    arguments=call.arguments,
                    **position,
                ),
            ]
        elif added["type"] == "custom_tool_call":
            frames += [
                self._frame(
                    "response.custom_tool_call_input.delta", delta=done["input"], **position
                ),
                self._frame(
                    "response.custom_tool_call_input.done", input=done["input"], **position
                ),
            ]
        frames.append(
            self._frame("response.output_item.done", item=self.output[index], output_index=index)
        )
        return frames


# --- routes ------------------------------------------------------------------------------


def _reasoning_key(app: Any) -> bytes:
    key: bytes | None = getattr(app.state, "reasoning_item_key", None)
    if key is None:
        settings = getattr(app.state, "settings", None)
        configured = settings.reasoning_item_key if settings else None
        key = configured.encode() if configured else secrets.token_bytes(32)
        app.state.reasoning_item_key = key
    return key


async def _serve(session_id: str, wire: ResponsesRequest, request: Request) -> Any:
    key = _reasoning_key(request.app)
    conversation = await convert(
        request,
        lambda: conversation_from_request(
            wire, reasoning=lambda value: open_reasoning(key, session_id, value)
        ),
    )
    seal: ReasoningSealer | None = None
    if "reasoning.encrypted_content" in wire.include:
        seal = lambda result_id, text: seal_reasoning(key, session_id, result_id, text)  # noqa: E731
    service = turn_service(request)
    stream = ResponseStream(wire, seal)
    return await serve_turn(
        request,
        session_id,
        "responses",
        conversation,
        streaming=conversation.stream,
        complete=lambda: service.complete(session_id, conversation),
        stream=lambda: service.stream(session_id, conversation),
        reply=lambda result: response_from_result(wire, result, seal),
        frames=stream.frames,
        on_error=stream.error,
    )


@router.post("/sessions/{session_id}/v1/responses", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def session_responses(session_id: str, body: ResponsesRequest, request: Request) -> Any:
    return await _serve(check_session_id(session_id), body, request)


@router.post("/v1/responses", openapi_extra=IDEMPOTENCY_KEY_DOC)
async def responses(body: ResponsesRequest, request: Request) -> Any:
    return await _serve(session_id_from_headers(request), body, request)
