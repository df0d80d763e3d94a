"""OpenAI Responses wire format, checked with the official `openai` SDK.

The SDK sends real requests (captured through an httpx transport and parsed by the
front-end) and parses the front-end's real responses and event streams.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from fastapi import FastAPI

from session_server.api import errors, responses
from session_server.conversation import Message
from session_server.results import StreamEvent
from tests.api.core_results import aiter_events, stream_events, turn_result, weather_call

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False,
    }
]


class Capture:
    """An httpx transport that records the SDK's request and answers with `reply`."""

    def __init__(self, reply: dict[str, Any] | str) -> None:
        self.reply = reply
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.bodies.append(json.loads(request.content))
        if isinstance(self.reply, str):
            return httpx2.Response(
                200, text=self.reply, headers={"content-type": "text/event-stream"}
            )
        return httpx2.Response(200, json=self.reply)


def client_for(capture: Capture) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="tk-s1",
        base_url="http://tokenkeep.test/sessions/s1/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(capture)),
    )


def wire(body: dict[str, Any]) -> responses.ResponsesRequest:
    return responses.ResponsesRequest.model_validate(body)


def reply_with_everything() -> Message:
    return Message(
        role="assistant",
        content="Checking both.",
        reasoning="Two cities.",
        tool_calls=[weather_call("call_a", "Paris"), weather_call("call_b", "Nice")],
    )


def test_item_list_becomes_one_conversation() -> None:
    request = wire({"model": "m", "input": "hi"})
    capture = Capture(
        responses.response_from_result(request, turn_result(Message("assistant", "ok")))
    )
    client_for(capture).responses.create(
        model="tiny",
        instructions="Be terse.",
        input=[
            {"role": "developer", "content": "Use metric units."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather"},
                    {"type": "input_text", "text": "in Paris?"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Need the tool."}],
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
                "status": "completed",
            },
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city":"Nice"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "20C"}],
            },
            # A reasoning item after function calls starts the next assistant turn.
            {
                "type": "reasoning",
                "id": "rs_2",
                "summary": [{"type": "summary_text", "text": "Summarised thought."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Both mild."}],
            },
            {"role": "user", "content": "Thanks"},
        ],
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.3,
        top_p=0.9,
        max_output_tokens=128,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        store=False,
        metadata={"run": "7"},
        include=["reasoning.encrypted_content"],
        truncation="disabled",
        previous_response_id=None,
    )
    conversation = responses.conversation_from_request(wire(capture.bodies[0]))
    assert [(m.role, m.content) for m in conversation.messages] == [
        ("system", "Be terse."),
        ("system", "Use metric units."),
        ("user", "Weather\nin Paris?"),
        ("assistant", "Checking."),
        ("tool", "18C"),
        ("tool", "20C"),
        ("assistant", "Both mild."),
        ("user", "Thanks"),
    ]
    first, second = conversation.messages[3], conversation.messages[6]
    assert first.reasoning == "Need the tool."
    assert [(c.id, c.name, c.arguments) for c in first.tool_calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'),
        ("call_2", "get_weather", '{"city":"Nice"}'),
    ]
    assert second.reasoning == "Summarised thought." and second.tool_calls == []
    assert [m.tool_call_id for m in conversation.messages[4:6]] == ["call_1", "call_2"]
    assert [t.name for t in conversation.tools] == ["get_weather"]
    assert conversation.tool_choice == {"name": "get_weather"}
    assert conversation.sampling == {"max_tokens": 128, "temperature": 0.3, "top_p": 0.9}
    assert conversation.response_format == {"json": {"type": "object"}}
    assert conversation.api == "responses" and conversation.previous_response_id is None


def test_string_input_and_previous_response() -> None:
    conversation = responses.conversation_from_request(
        wire({"model": "m", "input": "next", "previous_response_id": "resp_abc123"})
    )
    assert [(m.role, m.content) for m in conversation.messages] == [("user", "next")]
    assert conversation.previous_response_id == "abc123"
    assert conversation.messages[0].role == "user"  # the stored prompt has the instructions


def test_token_aware_fields_are_parsed() -> None:
    conversation = responses.conversation_from_request(
        wire(
            {
                "model": "m",
                "required_prefix_token_ids": [5, 6],
                "input": [
                    {"role": "user", "content": "hi"},
                    {
                        "type": "function_call",
                        "call_id": "c",
                        "name": "f",
                        "arguments": "{}",
                        "prompt_token_ids": [5, 6, 7],
                        "generation_token_ids": [8, 9],
                    },
                    {"type": "function_call_output", "call_id": "c", "output": "x"},
                ],
            }
        )
    )
    assert conversation.required_prefix_token_ids == [5, 6]
    assert conversation.messages[1].prompt_token_ids == [5, 6, 7]
    assert conversation.messages[1].generation_token_ids == [8, 9]


def test_reply_parsed_by_sdk() -> None:
    request = wire({"model": "m", "input": "hi", "tools": TOOLS, "store": False})
    result = turn_result(reply_with_everything(), finish_reason="tool_calls")
    response = client_for(
        Capture(responses.response_from_result(request, result))
    ).responses.create(model="m", input="hi")
    assert response.id == "resp_0123abcd" and response.status == "completed"
    assert [item.type for item in response.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    reasoning, _, first, second = response.output
    assert reasoning.content[0].text == "Two cities."
    assert response.output_text == "Checking both."
    assert (first.call_id, first.name, json.loads(first.arguments)) == (
        "call_a",
        "get_weather",
        {"city": "Paris"},
    )
    assert second.call_id == "call_b"
    assert response.usage.input_tokens == len(result.prompt_ids)
    assert response.usage.output_tokens == 4
    assert response.store is False and response.tools[0].name == "get_weather"
    assert response.model_extra["prompt_token_ids"] == result.prompt_ids
    assert response.model_extra["token_ids"] == result.choices[0].token_ids


def test_length_is_incomplete() -> None:
    request = wire({"model": "m", "input": "hi", "max_output_tokens": 4})
    result = turn_result(Message("assistant", "cut sh"), finish_reason="length", stop_reason=None)
    response = client_for(
        Capture(responses.response_from_result(request, result))
    ).responses.create(model="m", input="hi")
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "cut sh"


async def streamed(request: responses.ResponsesRequest, events: list[StreamEvent]) -> str:
    frames = responses.ResponseStream(request).frames(aiter_events(events))
    return b"".join([frame async for frame in frames]).decode()


async def test_stream_event_sequence() -> None:
    request = wire({"model": "m", "input": "hi", "tools": TOOLS})
    result = turn_result(reply_with_everything(), finish_reason="tool_calls")
    text = await streamed(
        request,
        stream_events(
            result, reasoning_pieces=["Two ", "cities."], content_pieces=["Checking ", "both."]
        ),
    )
    datas = [
        json.loads(frame.split("\n")[1].removeprefix("data: "))
        for frame in text.split("\n\n")
        if frame
    ]
    assert [d["type"] for d in datas] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert datas[0]["response"]["prompt_token_ids"] == result.prompt_ids
    assert datas[-1]["response"]["token_ids"] == result.choices[0].token_ids
    assert [d["output_index"] for d in datas if d["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
        3,
    ]


def comparable(response: Any) -> dict[str, Any]:
    """The response without the parsed_* fields the SDK's stream helper adds."""
    data = response.model_dump(mode="json")
    for item in data["output"]:
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return data


async def test_stream_parsed_by_sdk_matches_non_streaming() -> None:
    request = wire({"model": "m", "input": "hi"})
    result = turn_result(reply_with_everything(), finish_reason="tool_calls")
    body = await streamed(
        request,
        stream_events(
            result, reasoning_pieces=["Two ", "cities."], content_pieces=["Check", "ing ", "both."]
        ),
    )
    with client_for(Capture(body)).responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    whole = client_for(Capture(responses.response_from_result(request, result))).responses.create(
        model="m", input="hi"
    )
    assert "".join(deltas) == "Checking both."
    assert comparable(final) == comparable(whole)
    assert final.output_text == whole.output_text


async def test_stream_of_empty_reply_still_has_a_message() -> None:
    request = wire({"model": "m", "input": "hi"})
    result = turn_result(Message("assistant", ""))
    body = await streamed(request, stream_events(result, reasoning_pieces=[], content_pieces=[]))
    with client_for(Capture(body)).responses.stream(model="m", input="hi") as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["message"]
    assert final.output_text == ""


# --- errors, through the routes ----------------------------------------------------------


@pytest.fixture
def async_client() -> openai.AsyncOpenAI:
    """The routes alone: every request here is refused before it reaches the core."""
    app = FastAPI()
    errors.install(app)
    app.include_router(responses.router)
    return openai.AsyncOpenAI(
        api_key="tk-s1",
        base_url="http://tokenkeep.test/sessions/s1/v1",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)),
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m"}, "input: Field required"),
        ({"model": "m", "input": []}, "input: List should have at least 1 item"),
        (
            {"model": "m", "input": [{"type": "item_reference", "id": "x"}]},
            "input.0: Input tag 'item_reference'",
        ),
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            },
            "'(none)' URLs are not fetched",
        ),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "namespace", "tools": []}]},
            "namespace tools need a name",
        ),
        ({"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens: Input should"),
        ({"model": "m", "input": "hi", "background": True}, "background responses"),
        (
            {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "json_schema format needs a schema",
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    async_client: openai.AsyncOpenAI, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await async_client.post("/responses", body=body, cast_to=object)
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]


async def test_session_errors() -> None:
    app = FastAPI()
    errors.install(app)
    app.include_router(responses.router)
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://t"
    ) as http:
        body = {"model": "m", "input": "hi"}
        bad_id = await http.post("/sessions/bad%20id/v1/responses", json=body)
        no_session = await http.post(
            "/v1/responses", json=body, headers={"authorization": "Bearer sk-x"}
        )
        not_json = await http.post(
            "/sessions/s1/v1/responses",
            content=b"[1,",
            headers={"content-type": "application/json"},
        )
    for response, text in (
        (bad_id, "session ids are"),
        (no_session, "no session"),
        (not_json, "not valid JSON"),
    ):
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert text in response.json()["error"]["message"]
