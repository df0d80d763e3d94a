"""OpenAI Responses end to end: the official SDK, the real session core and tokenizer, the
engine double. Tool loops that resend every item, and loops that chain
`previous_response_id`, must both reach the engine as one contiguous token sequence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.api.stack import Stack, reply, serving, tool_call
from tests.engine_double import EngineDouble, HttpFault

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble().start()
    yield engine
    engine.stop()


async def ask(client: openai.AsyncOpenAI, stream: bool, **request: Any) -> Any:
    request = {"model": "tiny", "instructions": "You are a weather bot.", "tools": TOOLS, **request}
    if not stream:
        return await client.responses.create(**request)
    async with client.responses.stream(**request) as events:
        return await events.get_final_response()


def as_input(response: Any) -> list[dict[str, Any]]:
    """The output items as a client sends them back."""
    return [
        item.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for item in response.output
    ]


def outputs_for(response: Any, results: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": item.call_id, "output": results[item.name]}
        for item in response.output
        if item.type == "function_call"
    ]


async def single_segment(stack: Stack, session_id: str) -> dict[str, Any]:
    trajectory = await stack.trajectory(session_id)
    [branch] = trajectory["branches"]
    [segment] = branch["segments"]
    assert segment["token_ids"] == stack.engine_requests()[-1].prompt_ids + stack.sent[-1].token_ids
    return segment


def script_loop(stack: Stack) -> None:
    stack.script(
        tool_call("get_weather", '{"city":"Paris"}', think="Need the tool."),
        reply("<think>", "\nDone.\n", "</think>", "\n\n", "Paris", " is 18C."),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_resent_items_loop_is_contiguous(double: EngineDouble, stream: bool) -> None:
    async with serving(double) as stack:
        script_loop(stack)
        client = stack.openai("resp-items")
        items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await ask(client, stream, input=items)
        assert [item.type for item in first.output] == ["reasoning", "function_call"]
        assert json.loads(first.output[1].arguments) == {"city": "Paris"}
        items += as_input(first) + outputs_for(first, {"get_weather": "18C"})
        assert "token_ids" not in (first.model_extra or {})  # opt-in
        second = await ask(client, stream, input=items, extra_body={"return_token_ids": True})
        assert second.output_text == "Paris is 18C."
        assert second.output[0].content[0].text.strip() == "Done."
        assert second.usage.input_tokens == len(stack.engine_requests()[-1].prompt_ids)
        if not stream:
            assert second.model_extra["token_ids"] == stack.sent[-1].token_ids
        stack.assert_contiguous()
        stack.assert_engine_got("18C")  # the function_call_output, as the client sent it
        segment = await single_segment(stack, "resp-items")
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend"]
        assert {t["api"] for t in segment["turns"]} == {"responses"}


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_previous_response_id_loop_is_contiguous(double: EngineDouble, stream: bool) -> None:
    async with serving(double) as stack:
        script_loop(stack)
        client = stack.openai("resp-chain")
        first = await ask(client, stream, input="Weather in Paris?")
        assert first.id.startswith("resp_")
        second = await ask(
            client,
            stream,
            previous_response_id=first.id,
            input=outputs_for(first, {"get_weather": "18C"}),
        )
        assert second.previous_response_id == first.id
        assert second.output_text == "Paris is 18C."
        stack.assert_contiguous()
        stack.assert_engine_got("18C")
        await single_segment(stack, "resp-chain")


async def test_unknown_previous_response_id(double: EngineDouble) -> None:
    async with serving(double) as stack:
        client = stack.openai("resp-unknown")
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(
                model="tiny", input="hi", previous_response_id="resp_nope"
            )
        assert info.value.body["param"] == "previous_response_id"
        assert stack.engine_requests() == []


async def test_max_output_tokens_is_incomplete(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(reply("a long answer that keeps going", finish="length"))
        client = stack.openai("resp-length")
        response = await client.responses.create(
            model="tiny", input="hi", max_output_tokens=4, temperature=0.2, top_p=0.5
        )
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        sampling = stack.engine_requests()[0].sampling
        assert (sampling["max_tokens"], sampling["temperature"], sampling["top_p"]) == (4, 0.2, 0.5)


async def test_failures_get_openai_errors_and_store_nothing(double: EngineDouble) -> None:
    async with serving(double) as stack:
        client = stack.openai("resp-fail")
        stack.double.fail_next(HttpFault(503, "engine overloaded"))
        with pytest.raises(openai.APIStatusError) as info:
            await client.responses.create(model="tiny", input="hi")
        assert info.value.status_code >= 500 and "message" in info.value.body
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(
                model="tiny",
                input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            )
        assert bad.value.body["type"] == "invalid_request_error"
        summary = await stack.get("/sessions/resp-fail")
        assert summary["turns"] == 0


async def test_resent_items_after_previous_response_id(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(reply("one"), reply("two"), reply("three"))
        client = stack.openai("resp-mixed")
        items: list[dict[str, Any]] = []
        previous = None
        for question in ("a", "b", "c"):
            new = [{"role": "user", "content": question}]
            request = (
                {"input": new, "previous_response_id": previous}
                if question == "b"
                else {"input": items + new}
            )
            response = await client.responses.create(model="tiny", **request)
            previous = response.id
            items += new + as_input(response)
        stack.assert_contiguous()
        await single_segment(stack, "resp-mixed")
