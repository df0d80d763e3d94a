"""The OpenAI Agents SDK (`openai-agents`), unmodified, against a session URL: the engine
double scripts a function call, the SDK executes the Python tool and continues; the
session records one contiguous trajectory (Responses API, streamed and not)."""

from __future__ import annotations

from typing import Any

import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from tests.api.stack import Stack, reply, tool_call
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import live_stack
from tests.harnesses.recording import save_fixture

set_tracing_disabled(True)  # traces would be uploaded to OpenAI


def weather_agent(stack: Stack, session_id: str, calls: list[str]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return f"18C and sunny in {city}"

    client = AsyncOpenAI(
        base_url=f"{stack.url}/sessions/{session_id}/v1", api_key=f"tk-{session_id}", max_retries=0
    )
    return Agent(
        name="weather",
        instructions="Answer weather questions with the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel("tiny", openai_client=client),
    )


@pytest.mark.parametrize("mode", ["run", "run_streamed", "auto_previous_response_id"])
async def test_agent_tool_loop_is_contiguous(double: EngineDouble, mode: str) -> None:
    records: list[dict[str, Any]] = []
    with live_stack(double, records) as stack:
        stack.script(
            tool_call("get_weather", '{"city":"Paris"}', think="Use the tool."),
            tool_call("get_weather", '{"city": "Lyon"}'),
            reply("Paris ", "and Lyon: ", "18C."),
        )
        calls: list[str] = []
        agent = weather_agent(stack, f"agents-{mode}", calls)
        question = "Weather in Paris and Lyon?"
        if mode == "run_streamed":
            streamed = Runner.run_streamed(agent, question)
            async for _ in streamed.stream_events():
                pass
            output = streamed.final_output
        else:
            result = await Runner.run(
                agent, question, auto_previous_response_id=mode == "auto_previous_response_id"
            )
            output = result.final_output
        sent = list(records)  # the harness's requests, before the test's own
        assert output == "Paris and Lyon: 18C."
        assert calls == ["Paris", "Lyon"]  # the harness ran the tools the engine chose

        stack.assert_contiguous()
        trajectory = await stack.get(f"/sessions/agents-{mode}/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend", "extend"]

        posts = [r for r in sent if r["method"] == "POST"]
        assert [r["path"] for r in posts] == [f"/sessions/agents-{mode}/v1/responses"] * 3
        if mode == "auto_previous_response_id":
            assert all(r["body"].get("previous_response_id") for r in posts[1:])
        save_fixture(
            f"openai-agents-{mode}",
            "openai-agents==0.24.0",
            sent,
            [c.token_ids for c in stack.sent],
        )
