"""One session driven through all three APIs yields one trajectory: Chat Completions, then
Anthropic Messages, then Responses continue each other's turns token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.api.stack import reply, serving, tool_call
from tests.engine_double import EngineDouble

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
DESCRIPTION = "Current weather for a city"
SYSTEM = "You are a weather bot."


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble().start()
    yield engine
    engine.stop()


async def test_chat_then_messages_then_responses(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(
            tool_call("get_weather", '{"city":"Paris"}'),
            tool_call("get_weather", '{"city":"Nice"}'),
            reply("Both ", "are mild."),
        )
        session = "cross-api"
        chat = await stack.openai(session).chat.completions.create(
            model="tiny",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Weather in Paris and Nice?"},
            ],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": DESCRIPTION,
                        "parameters": PARAMETERS,
                    },
                }
            ],
        )
        [call] = chat.choices[0].message.tool_calls

        message = await stack.anthropic(session).messages.create(
            model="tiny",
            max_tokens=100,
            system=SYSTEM,
            tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}],
            messages=[
                {"role": "user", "content": "Weather in Paris and Nice?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": call.id,
                            "name": call.function.name,
                            "input": json.loads(call.function.arguments),
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}],
                },
            ],
        )
        [use] = message.content

        response = await stack.openai(session).responses.create(
            model="tiny",
            instructions=SYSTEM,
            tools=[
                {
                    "type": "function",
                    "name": "get_weather",
                    "description": DESCRIPTION,
                    "parameters": PARAMETERS,
                }
            ],
            input=[
                {"role": "user", "content": "Weather in Paris and Nice?"},
                {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": "get_weather",
                    "arguments": call.function.arguments,
                },
                {"type": "function_call_output", "call_id": call.id, "output": "18C"},
                {
                    "type": "function_call",
                    "call_id": use.id,
                    "name": use.name,
                    "arguments": json.dumps(use.input),
                },
                {"type": "function_call_output", "call_id": use.id, "output": "20C"},
            ],
        )
        assert response.output_text == "Both are mild."

        stack.assert_contiguous()
        trajectory = await stack.trajectory(session, every_sample=True)
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert [(t["kind"], t["api"]) for t in segment["turns"]] == [
            ("first", "chat"),
            ("extend", "messages"),
            ("extend", "responses"),
        ]
