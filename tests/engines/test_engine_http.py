"""The lean engine client (session_server/engine_http.py) as EngineClient uses it, against the
vLLM-protocol double over real TCP: keep-alive and its expiry, the connection limit and the
pool timeout, the read timeout while a stream stalls, a stream left early; https and a URL
with credentials through httpx."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from session_server import engines
from session_server.engines import EngineClient, EngineError, GenerationDelta, StreamStart
from tests.engine_double import EngineDouble, ScriptedCompletion

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
IM_END = 151645
MODEL = "tokenkeep-tiny-qwen3"
SAMPLING: dict[str, Any] = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}


def answer(tokens: int) -> Any:
    return lambda prompt, sampling: ScriptedCompletion([4] * tokens + [IM_END])


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 30  # a bound for a hang, not a timing claim
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_kept_connection_expires_before_the_engine_would_close_it(
    engine_double: EngineDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engines, "KEEPALIVE_EXPIRY_S", 0.3)
    engine_double.default = answer(1)
    async with EngineClient([engine_double.url], model=MODEL, health_interval_s=60) as client:
        await client.generate("s", PROMPT, SAMPLING)
        await client.generate("s", PROMPT, SAMPLING)
        await asyncio.sleep(0.6)  # idle past the expiry: not reused
        await client.generate("s", PROMPT, SAMPLING)
    first, second, third = (request.client_port for request in engine_double.requests)
    assert first == second != third
    headers = engine_double.requests[0].headers
    assert headers["x-session-id"] == "s"
    assert headers["content-type"] == "application/json"
    assert headers["accept-encoding"] == "identity"  # nothing decodes a compressed reply


async def test_requests_beyond_the_connection_limit_wait_their_turn(
    engine_double: EngineDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_double.default = answer(1)
    monkeypatch.setattr(engine_double, "latency_s", 0.1)
    async with EngineClient(
        [engine_double.url], model=MODEL, health_interval_s=60, max_connections=1
    ) as client:
        generations = await asyncio.gather(
            *(client.generate(f"s{i}", PROMPT, SAMPLING) for i in range(4))
        )
    assert all(g.choices[0].token_ids == [4, IM_END] for g in generations)
    assert len({request.client_port for request in engine_double.requests}) == 1


async def test_no_free_connection_within_the_pool_timeout_is_a_503_not_a_dead_engine(
    engine_double: EngineDouble,
) -> None:
    engine_double.default = answer(200)
    engine_double.chunk_delay_s = 0.02
    async with EngineClient(
        [engine_double.url], model=MODEL, health_interval_s=60, max_connections=1, timeout_s=0.3
    ) as client:
        async with contextlib.aclosing(client.stream("held", PROMPT, SAMPLING)) as held:
            assert isinstance(await anext(held), StreamStart)  # its connection is taken
            with pytest.raises(EngineError) as raised:
                await client.generate("waits", PROMPT, SAMPLING)
        assert raised.value.status == 503
        assert "PoolTimeout" in raised.value.message
        [replica] = client.replicas
        assert replica.healthy and replica.failures == 0
        engine_double.chunk_delay_s = 0.0
        # Leaving the stream gave the slot back.
        generation = await client.generate("next", PROMPT, SAMPLING)
        assert generation.choices[0].token_ids == [4] * SAMPLING["max_tokens"]


async def test_a_stream_that_stalls_after_its_first_token_times_out_with_504(
    engine_double: EngineDouble,
) -> None:
    engine_double.default = answer(3)
    engine_double.chunk_delay_s = 2.0
    events: list[Any] = []
    async with EngineClient(
        [engine_double.url], model=MODEL, health_interval_s=60, timeout_s=0.3
    ) as client:
        with pytest.raises(EngineError) as raised:
            async for event in client.stream("s", PROMPT, SAMPLING):
                events.append(event)
        assert raised.value.status == 504
        assert "ReadTimeout" in raised.value.message
        assert isinstance(events[0], StreamStart)  # after the first chunk: not retried
        assert len(engine_double.requests) == 1
        engine_double.chunk_delay_s = 0.0
        await until(lambda: engine_double.streams_abandoned == 1, "the stream was not closed")
        generation = await client.generate("s", PROMPT, SAMPLING)
        assert generation.choices[0].token_ids == [4, 4, 4, IM_END]


async def test_leaving_a_stream_early_closes_its_connection(engine_double: EngineDouble) -> None:
    """vLLM aborts a request whose connection closes: the client must not keep it."""
    engine_double.default = answer(200)
    engine_double.chunk_delay_s = 0.02
    async with EngineClient([engine_double.url], model=MODEL, health_interval_s=60) as client:
        async with contextlib.aclosing(client.stream("s", PROMPT, SAMPLING)) as events:
            async for event in events:
                if isinstance(event, GenerationDelta):
                    break
        await until(lambda: engine_double.streams_abandoned == 1, "the engine kept generating")
        engine_double.chunk_delay_s = 0.0
        await client.generate("s", PROMPT, SAMPLING)
    streamed, generated = (request.client_port for request in engine_double.requests)
    assert streamed != generated


async def test_an_https_engine_goes_through_httpx(engine_double: EngineDouble) -> None:
    """The double speaks plain HTTP: httpx's TLS handshake fails where the lean client (which
    is plain http only) would have been answered."""
    engine_double.default = answer(1)
    https = engine_double.url.replace("http://", "https://")
    async with EngineClient([https], model=MODEL, health_interval_s=60) as client:
        with pytest.raises(EngineError) as raised:
            await client.generate("s", PROMPT, SAMPLING)
    assert raised.value.status == 503
    assert "SSL" in raised.value.message
    assert engine_double.requests == []


async def test_an_engine_url_with_credentials_goes_through_httpx(
    engine_double: EngineDouble,
) -> None:
    """httpx sends a URL's user and password as basic auth; the lean client would not."""
    engine_double.default = answer(1)
    url = engine_double.url.replace("http://", "http://user:secret@")
    async with EngineClient([url], model=MODEL, health_interval_s=60) as client:
        await client.generate("s", PROMPT, SAMPLING)
    [request] = engine_double.requests
    assert request.headers["authorization"] == "Basic dXNlcjpzZWNyZXQ="
