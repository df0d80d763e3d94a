"""Tier 2: Anthropic Messages and OpenAI Responses, streamed, multi-turn, against the real
vLLM CPU engine (tiny random-weights model with the real Qwen3 tokenizer). Replies are
random text, so the loop is plain turns; the engine's own report of each prompt is proved
against the spliced one by the core, and the session must come out as one segment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from session_server.app import build_service, create_app
from session_server.settings import Settings
from tests.vllm_fixture import RunningEngine, vllm_engine

__all__ = ["vllm_engine"]
BASE = "http://tokenkeep.test"
# Greedy and seeded: the random-weights model then says the same thing on every run.
GREEDY = {"temperature": 0, "seed": 7}

pytestmark = pytest.mark.vllm


@asynccontextmanager
async def real_stack(engine: RunningEngine) -> AsyncIterator[httpx2.AsyncBaseTransport]:
    config = Settings(
        engine_urls=[engine.url],
        model=engine.served_model_name,
        tokenizer=str(engine.model_dir),
        context_length=engine.max_model_len,
    )
    service = build_service(config)
    app = create_app(config, service)
    await service.engine.start()
    try:
        yield httpx2.ASGITransport(app=app)
    finally:
        await service.engine.close()


async def one_segment(transport: httpx2.AsyncBaseTransport, session_id: str) -> list[Any]:
    async with httpx2.AsyncClient(transport=transport, base_url=BASE) as http:
        trajectory = (await http.get(f"/sessions/{session_id}/trajectory")).json()
    [branch] = trajectory["branches"]
    [segment] = branch["segments"]
    return segment["turns"]


async def create_session(transport: httpx2.AsyncBaseTransport, session_id: str) -> None:
    async with httpx2.AsyncClient(transport=transport, base_url=BASE) as http:
        created = await http.post("/sessions", json={"id": session_id, "sampling": GREEDY})
        assert created.status_code == 201


async def test_messages_stream_turns(vllm_engine: RunningEngine) -> None:
    async with real_stack(vllm_engine) as transport:
        await create_session(transport, "vllm-messages")
        client = anthropic.AsyncAnthropic(
            api_key="tk-vllm-messages",
            base_url=f"{BASE}/sessions/vllm-messages",
            http_client=httpx2.AsyncClient(transport=transport),
            max_retries=0,
        )
        history: list[dict[str, Any]] = []
        for question in ("Hello there.", "Tell me more.", "And then?"):
            history.append({"role": "user", "content": question})
            async with client.messages.stream(
                model="m", max_tokens=12, system="Be brief.", messages=history
            ) as stream:
                message = await stream.get_final_message()
            history.append(
                {
                    "role": "assistant",
                    "content": [block.model_dump(exclude_none=True) for block in message.content],
                }
            )
        turns = await one_segment(transport, "vllm-messages")
        assert [t["kind"] for t in turns] == ["first", "extend", "extend"]


async def test_responses_stream_turns(vllm_engine: RunningEngine) -> None:
    async with real_stack(vllm_engine) as transport:
        await create_session(transport, "vllm-responses")
        client = openai.AsyncOpenAI(
            api_key="tk-vllm-responses",
            base_url=f"{BASE}/sessions/vllm-responses/v1",
            http_client=httpx2.AsyncClient(transport=transport),
            max_retries=0,
        )
        previous = None
        for question in ("Hello there.", "Tell me more.", "And then?"):
            # The first turn starts the chain; the next ones continue it by id.
            request: dict[str, Any] = {"input": question}
            if previous:
                request["previous_response_id"] = previous
            async with client.responses.stream(
                model="m", instructions="Be brief.", max_output_tokens=12, **request
            ) as stream:
                # The random model rarely ends a turn by itself: most turns are incomplete.
                [response] = [
                    event.response
                    async for event in stream
                    if event.type in ("response.completed", "response.incomplete")
                ]
            previous = response.id
        turns = await one_segment(transport, "vllm-responses")
        assert [t["kind"] for t in turns] == ["first", "extend", "extend"]
