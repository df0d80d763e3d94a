"""Bad input gets a clear error in the OpenAI shape with the right status, and the stored
session stays exactly as it was."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.engine_double import HttpFault, ScriptedCompletion, StreamErrorFault
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack

USER = [{"role": "user", "content": "Hello"}]


def _snapshot(stack: Stack, session_id: str) -> dict[str, Any]:
    with stack.http() as http:
        summary = http.get(f"/sessions/{session_id}").json()
        trajectory = http.get(f"/sessions/{session_id}/trajectory").json()
    return {"summary": summary, "trajectory": trajectory}


@pytest.fixture
def seeded(stack: Stack) -> Stack:
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Hi", END)))
    stack.openai("bad").chat.completions.create(model="m", messages=USER)
    return stack


def _assert_openai_error(response: Any, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"messages": [', None),
        ('{"messages": []}', "messages"),
        ('{"messages": "hello"}', "messages"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        ('{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        ('{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', "max_tokens"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', None),
    ],
)
def test_malformed_requests_are_400_and_change_nothing(
    seeded: Stack, body: str, param: str | None
) -> None:
    before = _snapshot(seeded, "bad")
    with seeded.http() as http:
        response = http.post(
            "/sessions/bad/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
    _assert_openai_error(response, 400, param)
    assert _snapshot(seeded, "bad") == before
    assert len(seeded.double.requests) == 1  # nothing reached the engine


@pytest.mark.parametrize("session_id", ["bad$id", "x" * 129, "sp ace"])
def test_invalid_session_ids(stack: Stack, session_id: str) -> None:
    with stack.http() as http:
        response = http.post(f"/sessions/{session_id}/v1/chat/completions", json={"messages": USER})
        _assert_openai_error(response, 400, "session_id")
        no_session = http.post("/v1/chat/completions", json={"messages": USER})
        _assert_openai_error(no_session, 400, "session_id")
        created = http.post("/sessions", json={"id": session_id})
        assert created.status_code == 400


def test_prompt_over_the_context_is_400(seeded: Stack) -> None:
    before = _snapshot(seeded, "bad")
    huge = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError) as raised:
        seeded.openai("bad").chat.completions.create(model="m", messages=huge)
    assert "context" in raised.value.message
    assert _snapshot(seeded, "bad") == before


def test_engine_failure_is_a_5xx_and_stores_nothing(seeded: Stack) -> None:
    before = _snapshot(seeded, "bad")
    seeded.double.fail_next(*[HttpFault(500)] * 3)
    follow = [*USER, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "x"}]
    with pytest.raises(openai.APIStatusError) as raised:
        seeded.openai("bad").chat.completions.create(model="m", messages=follow)
    assert raised.value.status_code in (502, 503)
    assert _snapshot(seeded, "bad") == before


def test_engine_rejection_passes_through_as_400(seeded: Stack) -> None:
    before = _snapshot(seeded, "bad")
    seeded.double.fail_next(HttpFault(400, "prompt is too long", "BadRequestError"))
    with pytest.raises(openai.BadRequestError):
        seeded.openai("bad").chat.completions.create(
            model="m",
            messages=[
                *USER,
                {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": "y"},
            ],
        )
    assert _snapshot(seeded, "bad") == before


def test_error_mid_stream_is_reported_in_band_and_stores_nothing(seeded: Stack) -> None:
    before = _snapshot(seeded, "bad")
    seeded.double.script(ScriptedCompletion(tokens(seeded.model, "a", "b", "c", END)))
    seeded.double.fail_next(StreamErrorFault(after_tokens=2))
    stream = seeded.openai("bad").chat.completions.create(
        model="m",
        stream=True,
        messages=[*USER, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "z"}],
    )
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert _snapshot(seeded, "bad") == before


def test_unknown_session_is_404_when_not_created_on_first_use(
    qwen3_model: Any, engine_double: Any
) -> None:
    from tests.session.conftest import make_stack

    for stack in make_stack(
        qwen3_model, engine_double, "memory", None, create_sessions_on_first_use=False
    ):
        with pytest.raises(openai.NotFoundError):
            stack.openai("nobody").chat.completions.create(model="m", messages=USER)
        with stack.http() as http:
            assert http.get("/sessions/nobody").status_code == 404
