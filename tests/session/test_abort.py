"""POST /sessions/{id}/abort: in-flight generations of one session are cut at the engine,
answered at once with an `aborted` error in their API's shape, their cut turns stored with
finish_reason "abort"; the session stays usable and no other session is touched."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from session_server.splice import ChatModel
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack, make_stack

USER = [{"role": "user", "content": "Write a long story."}]


def _when_engine_has(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(stack.double.requests) < count:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)


def _abort(stack: Stack, session_id: str, **body: Any) -> httpx.Response:
    with stack.http() as client:
        return client.post(f"/sessions/{session_id}/abort", json=body or None)


def _turns(stack: Stack, session_id: str) -> list[dict[str, Any]]:
    return [
        turn
        for branch in stack.trajectory(session_id)["branches"]
        for segment in branch["segments"]
        for turn in segment["turns"]
    ]


def _post(stack: Stack, path: str, body: dict[str, Any]) -> Callable[[], httpx.Response]:
    def send() -> httpx.Response:
        with stack.http() as client:
            return client.post(path, json=body)

    return send


@pytest.fixture(params=["memory", "redis"])
def one_slot(
    request: pytest.FixtureRequest,
    qwen3_model: ChatModel,
    engine_double: EngineDouble,
    redis_server: str,
) -> Iterator[Stack]:
    """A server that runs one generation at a time (`--max-inflight 1`): the rest queue."""
    yield from make_stack(qwen3_model, engine_double, request.param, redis_server, max_inflight=1)


def _queued(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 10
    while f"tokenkeep_queued_requests {count}.0" not in stack.http().get("/metrics").text:
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.02)


def test_abort_cuts_requests_still_waiting_for_an_admission_slot(one_slot: Stack) -> None:
    """Requests of the session queued behind another session's generation when the abort is
    recorded are answered with the abort error (every API's shape, through the SDKs) once
    they get a slot, without an engine call and with nothing stored."""
    stack = one_slot
    stack.double.script(*(ScriptedCompletion(tokens(stack.model, "Hi", END)) for _ in range(3)))
    assert stack.openai("cut").chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
    chat = stack.openai("cut")
    claude = anthropic.Anthropic(base_url=f"{stack.url}/sessions/cut", api_key="-", max_retries=0)
    queued: dict[str, Callable[[], Any]] = {
        "chat": lambda: chat.chat.completions.create(model="m", messages=USER),  # type: ignore[arg-type]
        "chat stream": lambda: list(
            chat.chat.completions.create(model="m", messages=USER, stream=True)  # type: ignore[arg-type]
        ),
        "messages": lambda: claude.messages.create(model="m", max_tokens=20, messages=USER),  # type: ignore[arg-type]
        "responses": lambda: chat.responses.create(model="m", input="Go."),
    }
    stack.double.latency_s = 2.0
    try:
        with ThreadPoolExecutor(5) as pool:
            busy = pool.submit(
                _post(stack, "/sessions/busy/v1/chat/completions", {"model": "m", "messages": USER})
            )
            _when_engine_has(stack, 2)
            answers = {name: pool.submit(send) for name, send in queued.items()}
            _queued(stack, len(queued))
            aborted = _abort(stack, "cut")
            assert busy.result().status_code == 200
            errors = {name: answer.exception(timeout=30) for name, answer in answers.items()}
    finally:
        stack.double.latency_s = 0.0
    # None of them had reached the turn service: the abort cut none there itself.
    assert aborted.status_code == 200 and aborted.json()["aborted"] == 0
    for name in ("chat", "chat stream", "responses"):
        error = errors[name]
        assert isinstance(error, openai.BadRequestError), (name, error)
        assert error.body["type"] == "aborted" and "before it reached the engine" in error.message  # type: ignore[index]
    assert isinstance(errors["messages"], anthropic.BadRequestError)
    assert errors["messages"].body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "aborted" in errors["messages"].message
    assert len(stack.double.requests) == 2  # the engine never saw them
    assert len(_turns(stack, "cut")) == 1  # nothing sampled, nothing stored
    # Requests sent after the abort are served.
    again = chat.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
    assert again.choices[0].message.content == "Hi"
    with stack.http() as client:
        assert "tokenkeep_aborted_requests_total 4.0" in client.get("/metrics").text


def test_abort_counts_a_resend_waiting_on_its_key_as_a_replay(stack: Stack) -> None:
    """A resend waiting on its Idempotency-Key is not a generation: the abort cuts (and
    counts) the first request only; the resend gets the stored cut reply, no engine call."""
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Once", " upon", END)))
    stack.double.latency_s = 3.0
    send = _post_keyed(
        stack, "/sessions/keyed/v1/chat/completions", {"model": "m", "messages": USER}, "k1"
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(send)
            _when_engine_has(stack, 1)
            resend = pool.submit(send)
            time.sleep(0.3)  # the resend waits on the key
            aborted = _abort(stack, "keyed")
            answers = first.result(), resend.result()
    finally:
        stack.double.latency_s = 0.0
    assert aborted.json()["aborted"] == 1
    assert answers[0].status_code == 400 and answers[0].json()["error"]["type"] == "aborted"
    assert answers[1].status_code == 200
    assert answers[1].json()["choices"][0]["finish_reason"] == "abort"
    assert len(stack.double.requests) == 1
    (turn,) = _turns(stack, "keyed")
    assert turn["finish_reason"] == "abort"


def test_abort_cuts_a_non_streamed_request_and_leaves_other_sessions_alone(stack: Stack) -> None:
    story = tokens(stack.model, "Once", " upon", " a", " time", END)
    stack.double.script(ScriptedCompletion(story), ScriptedCompletion(story))
    stack.double.latency_s = 3.0
    try:
        with ThreadPoolExecutor(2) as pool:
            other = pool.submit(
                _post(
                    stack, "/sessions/other/v1/chat/completions", {"model": "m", "messages": USER}
                )
            )
            _when_engine_has(stack, 1)
            cut = pool.submit(
                _post(stack, "/sessions/cut/v1/chat/completions", {"model": "m", "messages": USER})
            )
            _when_engine_has(stack, 2)
            started = time.monotonic()
            aborted = _abort(stack, "cut")
            answer = cut.result()
            latency = time.monotonic() - started
            assert aborted.status_code == 200 and aborted.json()["aborted"] == 1
            assert answer.status_code == 400 and answer.json()["error"]["type"] == "aborted"
            assert latency < 2.5  # the engine would have answered after 3 s
            assert other.result().status_code == 200  # the other session's turn is served
    finally:
        stack.double.latency_s = 0.0
    (turn,) = _turns(stack, "cut")
    assert turn["finish_reason"] == "abort"
    assert turn["completion_span"][0] == turn["completion_span"][1]
    assert _turns(stack, "other")[0]["finish_reason"] == "stop"
    # The session stays usable: the resend is a retry of the cut turn.
    stack.double.script(ScriptedCompletion(story))
    with stack.http() as client:
        again = client.post(
            "/sessions/cut/v1/chat/completions", json={"model": "m", "messages": USER}
        )
        assert again.status_code == 200 and again.json()["tokenkeep"]["kind"] == "retry"
        metrics = client.get("/metrics").text
    assert "tokenkeep_aborted_requests_total 1.0" in metrics


def _stream_until_aborted(
    stack: Stack, path: str, body: dict[str, Any], session_id: str
) -> list[str]:
    """Read the stream; after its second data line, abort the session from another thread.
    Returns the stream's lines."""
    lines: list[str] = []
    aborted = False
    with stack.http() as client, client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        data = 0
        for line in response.iter_lines():
            lines.append(line)
            data += line.startswith("data:")
            if data == 2 and not aborted:
                aborted = True
                threading.Thread(target=_abort, args=(stack, session_id), daemon=True).start()
    return lines


def test_abort_cuts_a_chat_stream_in_band_and_stores_the_tokens_that_arrived(
    stack: Stack,
) -> None:
    story = tokens(stack.model, *(f" word{i}" for i in range(40)), END)
    stack.double.script(ScriptedCompletion(story))
    stack.double.chunk_delay_s = 0.1
    lines = _stream_until_aborted(
        stack,
        "/sessions/streamcut/v1/chat/completions",
        {"model": "m", "messages": USER, "stream": True},
        "streamcut",
    )
    assert '"type":"aborted"' in lines[-1].replace(" ", "") or any(
        '"aborted"' in line for line in lines[-3:]
    )
    (turn,) = _turns(stack, "streamcut")
    assert turn["finish_reason"] == "abort"
    stored = stack.trajectory("streamcut")["branches"][0]["segments"][0]
    sampled = stored["token_ids"][turn["completion_span"][0] :]
    # Cut before the end (not a wall-clock bound: what was stored, and the engine told).
    assert 0 < len(sampled) < len(story) and sampled == story[: len(sampled)]
    time.sleep(0.3)
    assert stack.double.streams_abandoned == 1  # the engine stopped generating


def test_abort_in_messages_and_responses_shapes(stack: Stack) -> None:
    story = tokens(stack.model, *(f" word{i}" for i in range(40)), END)
    stack.double.script(ScriptedCompletion(story))
    stack.double.chunk_delay_s = 0.1
    lines = _stream_until_aborted(
        stack,
        "/sessions/claude/v1/messages",
        {"model": "m", "max_tokens": 100, "messages": USER, "stream": True},
        "claude",
    )
    assert "event: error" in lines
    error_line = lines[lines.index("event: error") + 1]
    assert '"type":"error"' in error_line.replace(" ", "")
    stack.double.chunk_delay_s = 0.0
    stack.double.script(ScriptedCompletion(story))
    stack.double.latency_s = 3.0
    try:
        with ThreadPoolExecutor(1) as pool:
            pending: Future[httpx.Response] = pool.submit(
                _post(stack, "/sessions/resp/v1/responses", {"model": "m", "input": "Go."})
            )
            _when_engine_has(stack, 2)
            assert _abort(stack, "resp").json()["aborted"] == 1
            answer = pending.result()
    finally:
        stack.double.latency_s = 0.0
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "aborted"
    assert _turns(stack, "resp")[0]["finish_reason"] == "abort"


def _post_keyed(
    stack: Stack, path: str, body: dict[str, Any], key: str
) -> Callable[[], httpx.Response]:
    def send() -> httpx.Response:
        with stack.http() as client:
            return client.post(path, json=body, headers={"Idempotency-Key": key})

    return send


def test_abort_bad_input(stack: Stack) -> None:
    assert _abort(stack, "nobody").status_code == 404
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Hi", END)))
    with stack.http() as client:
        client.post("/sessions/done/v1/chat/completions", json={"model": "m", "messages": USER})
        assert _abort(stack, "done").json() == {"id": "done", "aborted": 0, "finish": None}
        finished = client.post("/sessions/done/abort", json={"finish": True}).json()
        assert finished["finish"]["metadata"] == {"status": "aborted"}
        assert finished["finish"]["status"] == "aborted"
        again = client.post("/sessions/done/abort")
        assert again.status_code == 409
        assert client.post("/sessions/done/abort", json={"finish": "x"}).status_code == 400
    assert len(_turns(stack, "done")) == 1
