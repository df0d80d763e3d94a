"""EngineClient against the vLLM-protocol test double (tests/engine_double.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from session_server.engine_replicas import rendezvous_order
from session_server.engines import (
    EngineClient,
    EngineError,
    GenerationDelta,
    Protocol,
    StreamStart,
)
from tests.engine_double import (
    COMPLETIONS_PATH,
    GENERATE_PATH,
    DropFault,
    EngineDouble,
    HttpFault,
    ScriptedCompletion,
    StreamErrorFault,
    fake_logprob,
)

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
IM_END = 151645
MODEL = "tokenkeep-tiny-qwen3"
SAMPLING: dict[str, Any] = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}


def session_ranked_first(doubles: list[EngineDouble], target: EngineDouble) -> str:
    """A session id whose rendezvous order puts `target` first."""
    urls = [d.url for d in doubles]
    for i in range(1000):
        if rendezvous_order(f"sess-{i}", urls)[0] == target.url:
            return f"sess-{i}"
    raise AssertionError("no session maps to the target replica")


async def collect(events: AsyncIterator[Any]) -> list[Any]:
    return [event async for event in events]


@pytest.fixture
async def client(engine_doubles: list[EngineDouble]) -> AsyncIterator[EngineClient]:
    async with EngineClient(
        [d.url for d in engine_doubles], model=MODEL, health_interval_s=60
    ) as engine_client:
        yield engine_client


async def test_generate_sends_token_prompt_and_returns_sampled_tokens(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    target = engine_doubles[0]
    session = session_ranked_first(engine_doubles, target)
    # Non-canonical pieces a real model emits but re-tokenization would merge.
    target.script(ScriptedCompletion([27, 14172, 28696, 29, IM_END], logprobs=[-0.5] * 5))
    sampling = {
        **SAMPLING,
        "seed": 3,
        "stop_token_ids": [151643],
        "structured_outputs": {"json": {"type": "object"}},
    }

    generation = await client.generate(session, PROMPT, sampling)

    assert generation.engine_url == target.url
    assert generation.prompt_ids == PROMPT
    [choice] = generation.choices
    assert choice.token_ids == [27, 14172, 28696, 29, IM_END]
    assert choice.logprobs == [-0.5] * 5
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)
    assert generation.latency_s > 0
    [request] = target.requests
    assert request.path == GENERATE_PATH
    assert request.prompt_ids == PROMPT
    assert request.sampling == {**sampling, "logprobs": 0}  # passed through, plus logprobs
    assert request.body["return_token_ids"] is True
    assert request.body["stream"] is False
    assert request.body["model"] == "tokenkeep-tiny-qwen3"
    assert request.headers["x-session-id"] == session


async def test_caller_chosen_top_logprobs_are_kept(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    target = engine_doubles[0]
    target.script(ScriptedCompletion([5, 6]))
    await client.generate(
        session_ranked_first(engine_doubles, target), PROMPT, {**SAMPLING, "logprobs": 3}
    )
    assert target.requests[-1].sampling["logprobs"] == 3


async def test_max_tokens_cut_reports_length(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    target = engine_doubles[1]
    session = session_ranked_first(engine_doubles, target)
    target.script(ScriptedCompletion([1, 2, 3, 4, 5, IM_END]))

    generation = await client.generate(session, PROMPT, {**SAMPLING, "max_tokens": 3})

    [choice] = generation.choices
    assert choice.token_ids == [1, 2, 3]
    assert choice.finish_reason == "length"
    assert choice.logprobs == [fake_logprob(t) for t in (1, 2, 3)]


async def test_stream_yields_start_then_one_delta_per_token(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    target = engine_doubles[2]
    session = session_ranked_first(engine_doubles, target)
    target.script(ScriptedCompletion([11, 12, 151643], stop_reason=151643))

    events = await collect(client.stream(session, PROMPT, SAMPLING))

    assert events[0] == StreamStart(target.url, PROMPT)
    deltas = events[1:]
    assert all(isinstance(d, GenerationDelta) for d in deltas)
    assert [d.token_ids for d in deltas] == [[11], [12], [151643]]
    assert [d.logprobs for d in deltas] == [[fake_logprob(t)] for t in (11, 12, 151643)]
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert deltas[-1].stop_reason == 151643
    assert target.requests[0].body["stream"] is True


async def test_n_choices_are_indexed_in_both_modes(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    target = engine_doubles[0]
    session = session_ranked_first(engine_doubles, target)
    scripts = [ScriptedCompletion([1, 2, IM_END]), ScriptedCompletion([3, IM_END])]
    target.script(*scripts)

    generation = await client.generate(session, PROMPT, {**SAMPLING, "n": 2})
    assert [c.index for c in generation.choices] == [0, 1]
    assert [c.token_ids for c in generation.choices] == [[1, 2, IM_END], [3, IM_END]]

    target.script(*scripts)
    events = await collect(client.stream(session, PROMPT, {**SAMPLING, "n": 2}))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    for event in events[1:]:
        tokens[event.index] += event.token_ids
        finish[event.index] = event.finish_reason
    assert tokens == {0: [1, 2, IM_END], 1: [3, IM_END]}
    assert finish == {0: "stop", 1: "stop"}


async def test_session_sticks_to_one_replica_and_sessions_spread(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    for double in engine_doubles:
        double.default = lambda prompt, sampling: ScriptedCompletion([7, IM_END])

    first = await client.generate("sticky-session", PROMPT, SAMPLING)
    for _ in range(4):
        again = await client.generate("sticky-session", PROMPT, SAMPLING)
        assert again.engine_url == first.engine_url

    # Another client (another session-server process) picks the same replica.
    async with EngineClient([d.url for d in reversed(engine_doubles)], model=MODEL) as other:
        assert (await other.generate("sticky-session", PROMPT, SAMPLING)).engine_url == (
            first.engine_url
        )

    # Each session goes where rendezvous hashing ranks it first, so sessions spread over
    # every replica (the share itself depends on the ports: not asserted).
    urls = [d.url for d in engine_doubles]
    placed = {
        f"spread-{i}": (await client.generate(f"spread-{i}", PROMPT, SAMPLING)).engine_url
        for i in range(60)
    }
    assert placed == {session: rendezvous_order(session, urls)[0] for session in placed}
    assert set(placed.values()) == set(urls)


async def test_failure_before_first_token_moves_to_next_replica(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    first = engine_doubles[0]
    session = session_ranked_first(engine_doubles, first)
    second_url = rendezvous_order(session, [d.url for d in engine_doubles])[1]
    second = next(d for d in engine_doubles if d.url == second_url)
    second.default = lambda prompt, sampling: ScriptedCompletion([9, IM_END])

    first.fail_next(HttpFault(500))
    assert (await client.generate(session, PROMPT, SAMPLING)).engine_url == second.url

    first.fail_next(StreamErrorFault(after_tokens=0))
    first.script(ScriptedCompletion([1, IM_END]))
    events = await collect(client.stream(session, PROMPT, SAMPLING))
    assert events[0].engine_url == second.url
    assert [e.token_ids for e in events[1:]] == [[9], [IM_END]]

    first.fail_next(DropFault(after_tokens=0))
    first.script(ScriptedCompletion([1, IM_END]))
    events = await collect(client.stream(session, PROMPT, SAMPLING))
    assert events[0].engine_url == second.url
    # A 5xx or a dropped stream does not mark the replica down: it answered.
    assert all(r.healthy for r in client.replicas)


async def test_failure_after_first_token_is_not_retried(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    first = engine_doubles[0]
    session = session_ranked_first(engine_doubles, first)
    for fault in (DropFault(after_tokens=2), StreamErrorFault(after_tokens=1)):
        first.script(ScriptedCompletion([1, 2, 3, IM_END]))
        first.fail_next(fault)
        seen: list[Any] = []
        with pytest.raises(EngineError) as raised:
            async for event in client.stream(session, PROMPT, SAMPLING):
                seen.append(event)
        assert raised.value.status == 502
        assert isinstance(seen[0], StreamStart)
        assert len(seen) - 1 == fault.after_tokens
    assert all(not d.requests for d in engine_doubles[1:])


async def test_client_errors_pass_through_without_retry(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    first = engine_doubles[0]
    session = session_ranked_first(engine_doubles, first)

    first.fail_next(HttpFault(422, "bad structured output", "BadRequestError"))
    with pytest.raises(EngineError) as raised:
        await client.generate(session, PROMPT, SAMPLING)
    assert (raised.value.status, raised.value.message) == (422, "bad structured output")

    with pytest.raises(EngineError) as raised:
        await client.generate(session, [151936], SAMPLING)
    assert raised.value.status == 400
    assert raised.value.message == "Token id 151936 is out of vocabulary"

    # Streaming: vLLM answers 200 and sends the 400 as an error line.
    with pytest.raises(EngineError) as raised:
        await collect(client.stream(session, [9707] * 4097, SAMPLING))
    assert raised.value.status == 400
    assert "longer than the maximum model length of 4096" in raised.value.message

    assert all(not d.requests for d in engine_doubles[1:])


async def test_unknown_model_is_a_404_not_a_fallback(
    engine_doubles: list[EngineDouble],
) -> None:
    async with EngineClient([engine_doubles[0].url], model="other-model") as client:
        with pytest.raises(EngineError) as raised:
            await client.generate("s", PROMPT, SAMPLING)
        assert raised.value.status == 404
        assert client.replicas[0].protocol is Protocol.GENERATE


async def test_unreachable_replica_is_marked_down_and_comes_back(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    first = engine_doubles[0]
    session = session_ranked_first(engine_doubles, first)
    for double in engine_doubles:
        double.default = lambda prompt, sampling: ScriptedCompletion([4, IM_END])

    first.stop()
    moved = await client.generate(session, PROMPT, SAMPLING)
    assert moved.engine_url != first.url
    down = next(r for r in client.replicas if r.url == first.url)
    assert not down.healthy
    assert client.order_for(session)[0].url == moved.engine_url

    first.start()
    await client.check_health()
    assert down.healthy
    assert (await client.generate(session, PROMPT, SAMPLING)).engine_url == first.url


async def test_turns_reuse_a_kept_connection_and_replace_one_the_engine_closed(
    engine_double: EngineDouble, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine connection is kept between turns (one write per request, no new connect),
    and when the engine closes it while idle (a restart, its keep-alive timeout) the next
    turn opens a new one: answered on the first try, the replica never marked down."""
    engine_double.default = lambda prompt, sampling: ScriptedCompletion([4, IM_END])
    async with EngineClient([engine_double.url], model=MODEL, health_interval_s=60) as client:
        for _ in range(3):
            assert (await client.generate("kept", PROMPT, SAMPLING)).choices[0].token_ids == [
                4,
                IM_END,
            ]
        ports = {request.client_port for request in engine_double.requests}
        assert len(ports) == 1, "each turn opened a new engine connection"

        engine_double.stop()
        engine_double.start()
        await asyncio.sleep(0.2)  # the closed connection's end reaches this event loop
        engine_double.requests.clear()
        generation = await client.generate("kept", PROMPT, SAMPLING)
        assert generation.choices[0].token_ids == [4, IM_END]
        assert len(engine_double.requests) == 1
        assert "failed before any token" not in caplog.text, "the turn was retried"
        [replica] = client.replicas
        assert replica.healthy and replica.failures == 0


async def test_health_checks_steer_traffic_and_readiness(
    engine_doubles: list[EngineDouble], client: EngineClient
) -> None:
    first = engine_doubles[0]
    session = session_ranked_first(engine_doubles, first)
    for double in engine_doubles:
        double.default = lambda prompt, sampling: ScriptedCompletion([4, IM_END])

    first.healthy = False
    await client.check_health()
    assert (await client.generate(session, PROMPT, SAMPLING)).engine_url != first.url
    assert not first.paths()  # skipped, not tried
    assert await client.ready()

    for double in engine_doubles:
        double.healthy = False
    await client.check_health()
    assert not await client.ready()

    first.healthy = True
    await client.check_health()
    assert await client.ready()
    assert (await client.generate(session, PROMPT, SAMPLING)).engine_url == first.url


async def test_background_health_loop_marks_replicas(engine_doubles: list[EngineDouble]) -> None:
    first = engine_doubles[0]
    async with EngineClient([first.url], model=MODEL, health_interval_s=0.05) as client:
        assert client.replicas[0].healthy
        first.healthy = False
        deadline = time.monotonic() + 60  # a bound for a hung loop, not a timing claim
        while client.replicas[0].healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not client.replicas[0].healthy
        first.healthy = True
        while not client.replicas[0].healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert client.replicas[0].healthy


async def test_all_replicas_unreachable_is_503(engine_doubles: list[EngineDouble]) -> None:
    urls = [d.url for d in engine_doubles]
    for double in engine_doubles:
        double.stop()
    async with EngineClient(urls, model=MODEL, connect_timeout_s=1) as client:
        assert not await client.ready()
        with pytest.raises(EngineError) as raised:
            await client.generate("s", PROMPT, SAMPLING)
        assert raised.value.status == 503
        with pytest.raises(EngineError) as raised:
            await collect(client.stream("s", PROMPT, SAMPLING))
        assert raised.value.status == 503


async def test_slow_engine_times_out_with_504_without_retry(
    engine_doubles: list[EngineDouble],
) -> None:
    first = engine_doubles[0]
    session = session_ranked_first(engine_doubles, first)

    answer = threading.Event()

    def slow(prompt: list[int], sampling: dict[str, Any]) -> ScriptedCompletion:
        answer.wait(60)  # until the client has given up: no race against the timeout
        return ScriptedCompletion([1, IM_END])

    first.default = slow
    try:
        async with EngineClient(
            [d.url for d in engine_doubles], model=MODEL, timeout_s=0.2
        ) as client:
            with pytest.raises(EngineError) as raised:
                await client.generate(session, PROMPT, SAMPLING)
    finally:
        answer.set()
    assert raised.value.status == 504
    assert all(not d.paths() for d in engine_doubles[1:])


async def test_engine_without_token_endpoint_falls_back_to_completions(
    engine_double: EngineDouble,
) -> None:
    engine_double.generate_endpoint = False
    engine_double.script(
        ScriptedCompletion([21, 22, IM_END], logprobs=[-1.0, -2.0, -3.0]),
        ScriptedCompletion([23, 151643], stop_reason=151643),
        ScriptedCompletion([24, IM_END]),
    )
    async with EngineClient([engine_double.url], model=MODEL) as client:
        generation = await client.generate("s", PROMPT, SAMPLING)
        assert generation.prompt_ids == PROMPT
        [choice] = generation.choices
        assert (choice.token_ids, choice.logprobs) == ([21, 22, IM_END], [-1.0, -2.0, -3.0])
        assert client.replicas[0].protocol is Protocol.COMPLETIONS

        events = await collect(client.stream("s", PROMPT, SAMPLING))
        assert events[0] == StreamStart(engine_double.url, PROMPT)
        assert [e.token_ids for e in events[1:]] == [[23], [151643]]
        assert events[-1].stop_reason == 151643

        await client.generate("s", PROMPT, SAMPLING)

    # One probe of the token endpoint, then completions only.
    assert engine_double.paths() == [GENERATE_PATH] + [COMPLETIONS_PATH] * 3
    request = engine_double.requests[1]
    assert request.prompt_ids == PROMPT
    assert request.sampling == {**SAMPLING, "logprobs": 0}
    assert request.body["return_token_ids"] is True


async def test_discovery_makes_each_address_of_a_host_a_replica(engine_double) -> None:
    """`localhost` resolves to 127.0.0.1 (and ::1 where IPv6 is configured): with discovery
    each address becomes its own replica, and requests still reach the engine."""
    port = engine_double.port
    async with EngineClient([f"http://localhost:{port}"], model="m", discover=True) as client:
        urls = {replica.url for replica in client.replicas}
        assert f"http://127.0.0.1:{port}" in urls
        assert f"http://localhost:{port}" not in urls
    async with EngineClient([f"http://localhost:{port}"], model="m") as client:
        assert [replica.url for replica in client.replicas] == [f"http://localhost:{port}"]


class RefuseFirstConnects(httpx.AsyncBaseTransport):
    """A network-fault double: the first `refusals` generation requests fail to connect, as
    when a busy engine's accept queue overflows under a burst (no real engine can be made
    to do that on demand); health checks and everything after go over real TCP."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == GENERATE_PATH and self.refusals > 0:
            self.refusals -= 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.real.handle_async_request(request)

    async def aclose(self) -> None:
        await self.real.aclose()


async def test_one_refused_connect_does_not_mark_a_live_engine_down(
    engine_double: EngineDouble,
) -> None:
    engine_double.default = lambda prompt, sampling: ScriptedCompletion([4, IM_END])
    transport = RefuseFirstConnects(1)
    async with EngineClient(
        [engine_double.url], model=MODEL, health_interval_s=60, transport=transport
    ) as client:
        # Refused once: its health check answers, so the replica stays in rotation, and the
        # second round of attempts sends the same prompt to it again.
        generation = await client.generate("s", PROMPT, SAMPLING)
        assert generation.choices[0].token_ids == [4, IM_END]
        assert transport.refusals == 0
        assert client.replicas[0].healthy
        assert len(engine_double.requests) == 1  # sent once, answered once: stored once


async def test_a_replica_refusing_every_connect_gives_a_clean_503(
    engine_double: EngineDouble,
) -> None:
    transport = RefuseFirstConnects(10)
    async with EngineClient(
        [engine_double.url], model=MODEL, health_interval_s=60, transport=transport
    ) as client:
        with pytest.raises(EngineError) as raised:
            await client.generate("s", PROMPT, SAMPLING)
        assert raised.value.status == 503
        assert engine_double.requests == []


class AlterEcho(httpx.AsyncBaseTransport):
    """A fault double: rewrites the first token of the prompt the engine echoes (a real
    engine that mangles its input cannot be had on demand); everything goes over real TCP."""

    def __init__(self) -> None:
        self.real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.real.handle_async_request(request)
        if request.url.path != GENERATE_PATH:
            return response
        body = await response.aread()
        altered = body.replace(b'"prompt_token_ids":[151644,', b'"prompt_token_ids":[151643,')
        return httpx.Response(response.status_code, headers=response.headers, content=altered)

    async def aclose(self) -> None:
        await self.real.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echoed_prompt_is_reported_as_the_engine_sent_it(
    engine_double: EngineDouble, stream: bool
) -> None:
    engine_double.default = lambda prompt, sampling: ScriptedCompletion([4, IM_END])

    async def reported(client: EngineClient) -> list[int] | None:
        if not stream:
            return (await client.generate("s", PROMPT, SAMPLING)).prompt_ids
        events = await collect(client.stream("s", PROMPT, SAMPLING))
        return next(e for e in events if isinstance(e, StreamStart)).prompt_ids

    async with EngineClient([engine_double.url], model=MODEL) as client:
        assert await reported(client) == PROMPT  # the echo equals the sent bytes
    async with EngineClient([engine_double.url], model=MODEL, transport=AlterEcho()) as client:
        assert await reported(client) == [151643, *PROMPT[1:]]  # decoded, for the proof
