"""Anthropic Messages wire format, checked with the official `anthropic` SDK.

The SDK sends real requests (captured through an httpx transport and parsed by the
front-end) and parses the front-end's real responses and event streams, so a shape the SDK
would reject or misread fails here.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pytest
from fastapi import FastAPI

from session_server.api import errors, messages
from session_server.conversation import Message, ToolCall
from session_server.results import StreamEvent
from tests.api.core_results import (
    PROMPT_IDS,
    aiter_events,
    stream_events,
    turn_result,
    weather_call,
)

BILLING = "x-anthropic-billing-header: cc_version=2.1.330.440; cc_entrypoint=sdk-cli; cch=4f2a1;"


class Capture:
    """An httpx transport that records the SDK's request and answers with `reply`."""

    def __init__(self, reply: dict[str, Any] | str) -> None:
        self.reply = reply
        self.bodies: list[dict[str, Any]] = []
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        self.bodies.append(json.loads(request.content))
        if isinstance(self.reply, str):
            return httpx2.Response(
                200, text=self.reply, headers={"content-type": "text/event-stream"}
            )
        return httpx2.Response(200, json=self.reply)


def client_for(capture: Capture) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="tk-s1",
        base_url="http://tokenkeep.test/sessions/s1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(capture)),
        max_retries=0,
    )


async def streamed(events: list[StreamEvent]) -> str:
    frames = [frame async for frame in messages.message_stream(aiter_events(events))]
    return b"".join(frames).decode()


TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def test_request_becomes_one_conversation() -> None:
    capture = Capture(messages.message_response(turn_result(Message("assistant", "ok"))))
    client_for(capture).messages.create(
        model="claude-test",
        max_tokens=300,
        system=[
            {"type": "text", "text": BILLING},
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder/>"},
                    {"type": "text", "text": "Weather in Paris?"},
                ],
            },
            # Claude Code sends its environment block as a mid-conversation system turn.
            {"role": "system", "content": "# Environment\ncwd: /tmp"},  # type: ignore[misc]
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris", "units": {"c": True}},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "get_weather",
                        "input": {"city": "Nice"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "line 1"},
                            {"type": "text", "text": "2"},
                        ],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        tools=[
            *TOOLS,
            {"name": "Later", "description": "", "input_schema": {}, "defer_loading": True},
        ],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
        # This SDK release dropped the sampling arguments; older clients still send them.
        extra_body={"temperature": 0.5, "top_k": 20},
    )
    request = capture.requests[0]
    assert request.url.path == "/sessions/s1/v1/messages"
    # Claude Code sends `x-api-key`; this SDK release sends the key as a bearer token.
    assert (
        request.headers.get("x-api-key") == "tk-s1"
        or request.headers.get("authorization") == "Bearer tk-s1"
    )

    conversation = messages.conversation_from_request(
        messages.MessagesRequest.model_validate(capture.bodies[0])
    )
    assert [(m.role, m.content) for m in conversation.messages] == [
        ("system", BILLING + "\nYou are terse."),
        ("user", "<reminder/>\nWeather in Paris?"),
        ("system", "# Environment\ncwd: /tmp"),
        ("assistant", "Checking."),
        ("tool", "18C"),
        ("tool", "line 1\n2"),
        ("user", "And tomorrow?"),
    ]
    assistant = conversation.messages[3]
    assert assistant.reasoning == "Need the tool."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("toolu_1", "get_weather", {"city": "Paris", "units": {"c": True}}),
        ("toolu_2", "get_weather", {"city": "Nice"}),
    ]
    assert [m.tool_call_id for m in conversation.messages[4:6]] == ["toolu_1", "toolu_2"]
    # A deferred tool is not loaded into the model's context until the harness loads it.
    assert [t.name for t in conversation.tools] == ["get_weather"]
    assert conversation.tools[0].parameters == TOOLS[0]["input_schema"]
    assert conversation.tool_choice == "required"
    assert conversation.sampling == {
        "max_tokens": 300,
        "temperature": 0.5,
        "top_k": 20,
        "stop": ["END"],
    }
    assert conversation.api == "messages" and conversation.model == "claude-test"
    assert conversation.stream is False


def test_token_aware_fields_are_parsed() -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "required_prefix_token_ids": [1, 2, 3],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "yo",
                "prompt_token_ids": [1, 2],
                "generation_token_ids": [3, 4],
            },
            {"role": "user", "content": "again"},
        ],
    }
    conversation = messages.conversation_from_request(messages.MessagesRequest.model_validate(body))
    assert conversation.required_prefix_token_ids == [1, 2, 3]
    assert conversation.messages[1].prompt_token_ids == [1, 2]
    assert conversation.messages[1].generation_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"name": "get_weather"}),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "tools": TOOLS,
        "tool_choice": choice,
        "messages": [{"role": "user", "content": "hi"}],
    }
    conversation = messages.conversation_from_request(messages.MessagesRequest.model_validate(body))
    assert conversation.tool_choice == expected


def reply_with_everything() -> Message:
    return Message(
        role="assistant",
        content="Let me check both.",
        reasoning="The user wants weather.",
        tool_calls=[
            weather_call("call_a", "Paris"),
            ToolCall(id="call_b", name="get_weather", arguments='{"city": "Nic\\u00e9"}'),
        ],
    )


def test_token_ids_only_when_asked() -> None:
    asked = messages.message_response(turn_result(Message("assistant", "Hi.")))
    assert asked["prompt_token_ids"] == PROMPT_IDS and asked["token_ids"]
    plain = messages.message_response(
        turn_result(Message("assistant", "Hi."), return_token_ids=False)
    )
    assert "prompt_token_ids" not in plain and "token_ids" not in plain


def test_reply_parsed_by_sdk() -> None:
    result = turn_result(reply_with_everything(), finish_reason="tool_calls")
    message = client_for(Capture(messages.message_response(result))).messages.create(
        model="m", max_tokens=50, messages=[{"role": "user", "content": "weather?"}]
    )
    assert message.id == "msg_0123abcd"
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, first, second = message.content
    assert thinking.thinking == "The user wants weather." and thinking.signature
    assert text.text == "Let me check both."
    assert (first.id, first.name, first.input) == ("call_a", "get_weather", {"city": "Paris"})
    assert second.input == {"city": "Nicé"}
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == len(result.prompt_ids)
    assert message.usage.output_tokens == 4
    assert message.model_extra["prompt_token_ids"] == result.prompt_ids
    assert message.model_extra["token_ids"] == result.choices[0].token_ids


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("stop", 151645, ("end_turn", None)),
        ("stop", "END", ("stop_sequence", "END")),
        ("length", None, ("max_tokens", None)),
    ],
)
def test_stop_reasons(finish_reason: str, stop_reason: Any, expected: tuple[str, Any]) -> None:
    result = turn_result(
        Message("assistant", "text"), finish_reason=finish_reason, stop_reason=stop_reason
    )
    message = client_for(Capture(messages.message_response(result))).messages.create(
        model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}]
    )
    assert (message.stop_reason, message.stop_sequence) == expected


async def test_stream_event_sequence() -> None:
    result = turn_result(reply_with_everything(), finish_reason="tool_calls")
    text = await streamed(
        stream_events(
            result,
            reasoning_pieces=["The user ", "wants weather."],
            content_pieces=["Let me ", "check both."],
        )
    )
    frames = [block for block in text.split("\n\n") if block]
    names = [frame.split("\n")[0].removeprefix("event: ") for frame in frames]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",  # thinking: 2 deltas + signature
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",  # text: a delta and the held-back tail
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    datas = [json.loads(frame.split("\n")[1].removeprefix("data: ")) for frame in frames]
    assert all(data["type"] == name for data, name in zip(datas, names, strict=True))
    assert datas[0]["message"]["prompt_token_ids"] == result.prompt_ids
    assert datas[-2]["token_ids"] == result.choices[0].token_ids
    assert [d["index"] for d in datas if d["type"] == "content_block_start"] == [0, 1, 2, 3]


async def test_stream_parsed_by_sdk_matches_non_streaming() -> None:
    result = turn_result(reply_with_everything(), finish_reason="tool_calls")
    body = await streamed(
        stream_events(
            result,
            reasoning_pieces=["The user ", "wants weather."],
            content_pieces=["Let me ", "check ", "both."],
        )
    )
    client = client_for(Capture(body))
    with client.messages.stream(
        model="m", max_tokens=50, messages=[{"role": "user", "content": "weather?"}]
    ) as stream:
        final = stream.get_final_message()
    whole = client_for(Capture(messages.message_response(result))).messages.create(
        model="m", max_tokens=50, messages=[{"role": "user", "content": "weather?"}]
    )
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == ("tool_use", 4)
    assert final.id == whole.id


async def test_stream_of_plain_text() -> None:
    result = turn_result(Message("assistant", "Hello there"))
    body = await streamed(
        stream_events(result, reasoning_pieces=[], content_pieces=["Hel", "lo there"])
    )
    with client_for(Capture(body)).messages.stream(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Hello there"
    assert [b.type for b in final.content] == ["text"]
    assert final.stop_reason == "end_turn"


# --- errors, through the routes ----------------------------------------------------------


@pytest.fixture
def async_client() -> anthropic.AsyncAnthropic:
    """The routes alone: every request here is refused before it reaches the core."""
    app = FastAPI()
    errors.install(app)
    app.include_router(messages.router)
    return anthropic.AsyncAnthropic(
        api_key="tk-s1",
        base_url="http://tokenkeep.test/sessions/s1",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)),
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            "max_tokens: Field required",
        ),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages: List should have at least"),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "messages.0.content.0.image.source.type: Field required",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ],
            },
            "tool_use blocks are not allowed in user messages",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                    }
                ],
            },
            "tool_result blocks belong in user messages",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "temperature": 1.5,
                "messages": [{"role": "user", "content": "hi"}],
            },
            "temperature: Input should be less",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "messages": [{"role": "user", "content": "hi"}],
            },
            "server tool 'web_search_20250305'",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "tool_choice": {"type": "tool"},
                "messages": [{"role": "user", "content": "hi"}],
            },
            "tool_choice of type 'tool' needs",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "assistant", "content": "x", "generation_token_ids": [-1]}],
            },
            "messages.0.generation_token_ids.0: Input should be greater than or equal to 0",
        ),
    ],
)
async def test_bad_requests_get_anthropic_errors(
    async_client: anthropic.AsyncAnthropic, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        await async_client.post("/v1/messages", body=body, cast_to=object)
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(message) or message in error["error"]["message"]


async def test_session_errors() -> None:
    app = FastAPI()
    errors.install(app)
    app.include_router(messages.router)
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        bad_id = await http.post("/sessions/bad%20id/v1/messages", json=body)
        no_session = await http.post("/v1/messages", json=body, headers={"x-api-key": "sk-x"})
        not_json = await http.post(
            "/sessions/s1/v1/messages",
            content=b"{oops",
            headers={"content-type": "application/json"},
        )
    for response, text in (
        (bad_id, "session ids are"),
        (no_session, "no session"),
        (not_json, "not valid JSON"),
    ):
        assert response.status_code == 400
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert text in response.json()["error"]["message"]
