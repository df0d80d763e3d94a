"""Redis unreachable: every API answers 503 in its own error shape with Retry-After, through
the official SDKs, readiness fails, and nothing reaches the engine."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx2
import openai
import pytest

from tests.api.stack import BASE, serving
from tests.engine_double import EngineDouble
from tests.redis_server import _free_loopback_port


@pytest.fixture
def engine_double() -> Iterator[EngineDouble]:
    engine = EngineDouble().start()
    yield engine
    engine.stop()


@pytest.fixture
def dead_redis() -> str:
    return f"redis://127.0.0.1:{_free_loopback_port()}/0"  # nothing listens there


async def test_every_api_answers_503_with_retry_after(
    engine_double: EngineDouble, dead_redis: str
) -> None:
    async with serving(engine_double, redis_url=dead_redis, redis_retry_s=0.2) as stack:
        client = stack.openai("s1")
        with pytest.raises(openai.InternalServerError) as chat:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.InternalServerError) as responses:
            await client.responses.create(model="m", input="hi")
        with pytest.raises(openai.InternalServerError) as completions:
            await client.completions.create(model="m", prompt=[1, 2, 3])
        for failure in (chat, responses, completions):
            assert failure.value.status_code == 503
            assert failure.value.response.headers["retry-after"] == "1"
            assert "session store unavailable" in failure.value.body["message"]  # type: ignore[index]

        with pytest.raises(anthropic.InternalServerError) as messages:
            await stack.anthropic("s1").messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        assert messages.value.status_code == 503
        assert messages.value.response.headers["retry-after"] == "1"
        assert messages.value.body["type"] == "error"  # type: ignore[index]

        async with httpx2.AsyncClient(transport=stack.transport(), base_url=BASE) as http:
            ready = await http.get("/readyz")
            streamed = await http.post(
                "/sessions/s1/v1/chat/completions",
                json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
            )
        assert ready.status_code == 503 and ready.json()["store"] is False
        # The store fails before the stream starts: an ordinary 503, not a broken stream.
        assert streamed.status_code == 503 and streamed.headers["retry-after"] == "1"
        assert engine_double.requests == []
