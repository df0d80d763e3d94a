"""Anthropic Messages end to end: the official SDK, the real session core and tokenizer,
the engine double. Multi-turn tool loops must reach the engine as one contiguous token
sequence, streaming or not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.api.stack import Stack, reply, serving, tool_call
from tests.engine_double import EngineDouble, HttpFault, StreamErrorFault

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather for a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
SYSTEM = [{"type": "text", "text": "You are a weather bot."}]


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble().start()
    yield engine
    engine.stop()


async def ask(client: anthropic.AsyncAnthropic, stream: bool, **request: Any) -> Any:
    request = {"model": "tiny", "max_tokens": 200, "system": SYSTEM, "tools": TOOLS, **request}
    if not stream:
        return await client.messages.create(**request)
    async with client.messages.stream(**request) as events:
        return await events.get_final_message()


def echoed(message: Any) -> dict[str, Any]:
    """The assistant turn as a harness sends it back: the blocks it received."""
    return {
        "role": "assistant",
        "content": [block.model_dump(exclude_none=True) for block in message.content],
    }


async def single_segment(stack: Stack, session_id: str) -> dict[str, Any]:
    trajectory = await stack.trajectory(session_id)
    [branch] = trajectory["branches"]
    [segment] = branch["segments"]
    last = stack.engine_requests()[-1]
    assert segment["token_ids"] == last.prompt_ids + stack.sent[-1].token_ids
    sampled = [t for s in stack.sent for t in s.token_ids]
    assert [
        t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m
    ] == sampled
    return segment


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_tool_loop_is_contiguous(double: EngineDouble, stream: bool) -> None:
    async with serving(double) as stack:
        stack.script(
            # Compact JSON with an escaped character: re-rendering would change both.
            tool_call("get_weather", '{"city":"Par\\u00eds"}', think="Need the weather."),
            tool_call("get_weather", '{"city": "Nice"}', text="Also Nice."),
            reply("Par", "is is 18", "C; Nice 20C."),
        )
        client = stack.anthropic("msg-loop")
        history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await ask(client, stream, messages=history)
        assert [b.type for b in first.content] == ["thinking", "tool_use"]
        assert first.content[0].thinking.strip() == "Need the weather."
        assert first.content[1].input == {"city": "París"}
        assert first.stop_reason == "tool_use"

        history += [
            echoed(first),
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": first.content[1].id, "content": "18C"}
                ],
            },
        ]
        second = await ask(client, stream, messages=history)
        assert [b.type for b in second.content] == ["text", "tool_use"]
        assert second.content[0].text.strip() == "Also Nice."

        history += [
            echoed(second),
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": second.content[1].id,
                        # A result in blocks: every block reaches the engine.
                        "content": [
                            {"type": "text", "text": "20C"},
                            {"type": "text", "text": "light wind"},
                        ],
                    }
                ],
            },
        ]
        # Token IDs in replies are opt-in (O(history) bytes a harness never reads).
        assert "prompt_token_ids" not in (second.model_extra or {})
        third = await ask(client, stream, messages=history, extra_body={"return_token_ids": True})
        assert [b.type for b in third.content] == ["text"]
        assert third.content[0].text == "Paris is 18C; Nice 20C."
        assert third.stop_reason == "end_turn"
        assert third.usage.input_tokens == len(stack.engine_requests()[-1].prompt_ids)
        # Streaming: prompt_token_ids ride on message_start, token_ids on message_delta
        # (the SDK's accumulator keeps only the former).
        assert third.model_extra["prompt_token_ids"] == stack.engine_requests()[-1].prompt_ids
        if not stream:
            assert third.model_extra["token_ids"] == stack.sent[-1].token_ids

        stack.assert_contiguous()
        stack.assert_engine_got("20C", "light wind")  # every block of the tool result
        segment = await single_segment(stack, "msg-loop")
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend", "extend"]
        assert {t["api"] for t in segment["turns"]} == {"messages"}


async def test_sampling_reaches_the_engine(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(reply("Hi", " there"))
        client = stack.anthropic("msg-sampling")
        message = await client.messages.create(
            model="tiny",
            max_tokens=33,
            stop_sequences=["STOP"],
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": 0.25, "top_k": 7},
        )
        assert message.content[0].text == "Hi there"
        sampling = stack.engine_requests()[0].sampling
        assert sampling["max_tokens"] == 33
        assert sampling["temperature"] == 0.25 and sampling["top_k"] == 7
        assert sampling["stop"] == ["STOP"]


async def test_max_tokens_stop_reason(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(reply("a long answer that keeps going", finish="length"))
        client = stack.anthropic("msg-length")
        message = await client.messages.create(
            model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.stop_reason == "max_tokens"


async def test_count_tokens_matches_the_first_prompt(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(reply("ok"))
        client = stack.anthropic("msg-count")
        request = {
            "model": "tiny",
            "system": SYSTEM,
            "tools": TOOLS,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
        }
        counted = await client.messages.count_tokens(**request)
        await client.messages.create(max_tokens=10, **request)
        assert counted.input_tokens == len(stack.engine_requests()[0].prompt_ids)


async def test_engine_failure_is_an_anthropic_error_and_stores_nothing(
    double: EngineDouble,
) -> None:
    async with serving(double) as stack:
        client = stack.anthropic("msg-fail")
        stack.double.fail_next(HttpFault(503, "engine overloaded"))
        with pytest.raises(anthropic.APIStatusError) as info:
            await client.messages.create(
                model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.status_code >= 500
        assert info.value.body["type"] == "error"

        stack.double.fail_next(StreamErrorFault(after_tokens=2, message="engine crashed"))
        stack.double.script(reply("partial answer"))
        with pytest.raises(anthropic.APIStatusError) as mid_stream:
            async with client.messages.stream(
                model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            ) as events:
                await events.get_final_message()
        assert mid_stream.value.body["type"] == "error"
        summary = await stack.get("/sessions/msg-fail")
        assert summary["turns"] == 0


async def test_bad_input_changes_nothing(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(reply("ok"))
        client = stack.anthropic("msg-bad")
        await client.messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        before = await stack.get("/sessions/msg-bad/trajectory")
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(
                model="tiny",
                max_tokens=5,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                    }
                ],
            )
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert await stack.get("/sessions/msg-bad/trajectory") == before
        assert len(stack.engine_requests()) == 1
