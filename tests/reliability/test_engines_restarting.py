"""Every engine replica restarting or loading its model (issue 35, item 7): a live
`tokenkeep serve` stays ready, turns get a retryable 503 in their API's own shape at once,
and everything that needs no engine keeps working: sessions are created, finished,
exported, read and viewed, and /metrics answers. Once an engine is back, turns are served."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.engine_double import EngineDouble, ScriptedCompletion, running_doubles
from tests.security.conftest import ADMIN_KEY, OK_REPLY, LiveServer, start_server, stop_server

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def double() -> Iterator[EngineDouble]:
    with running_doubles(1) as doubles:
        doubles[0].default = lambda _prompt, _sampling: ScriptedCompletion(list(OK_REPLY))
        yield doubles[0]


@pytest.fixture
def server(tmp_path: Path, double: EngineDouble) -> Iterator[LiveServer]:
    live = start_server(
        tmp_path,
        double,
        "--admin-key",
        ADMIN_KEY,
        "--engine-health-interval-s",
        "1",
        env={"TOKENKEEP_STARTUP_CHECK": "false"},
    )
    try:
        yield live
    finally:
        stop_server(live)


def _ready(server: LiveServer) -> dict[str, object]:
    answer = httpx.get(f"{server.url}/readyz", timeout=5)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _wait_engine(server: LiveServer, up: bool) -> None:
    deadline = time.monotonic() + 20
    while _ready(server)["engine"] is not up:
        assert time.monotonic() < deadline, f"/readyz never said engine={up}"
        time.sleep(0.2)


def _chat(server: LiveServer, session_id: str, key: str) -> httpx.Response:
    with server.client(key) as client:
        return client.post(
            f"/sessions/{session_id}/v1/chat/completions", json={"model": "m", "messages": USER}
        )


def _assert_refused_in_every_shape(server: LiveServer, session_id: str, key: str) -> None:
    base = f"{server.url}/sessions/{session_id}/v1"
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    for call in (
        lambda: client.chat.completions.create(model="m", messages=USER),  # type: ignore[arg-type]
        lambda: client.responses.create(model="m", input="hi"),
        lambda: client.chat.completions.create(model="m", messages=USER, stream=True),  # type: ignore[arg-type]
    ):
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            call()
        assert time.monotonic() - started < 5  # at once, not after connect timeouts
        assert refused.value.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
        error = refused.value.response.json()["error"]
        assert error["type"] == "EngineUnavailable"
        assert "no engine replica is ready" in error["message"]
    claude = anthropic.Anthropic(
        base_url=f"{server.url}/sessions/{session_id}", api_key=key, max_retries=0
    )
    with pytest.raises(anthropic.InternalServerError) as refused_anthropic:
        claude.messages.create(model="m", max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert refused_anthropic.value.status_code == 503
    assert refused_anthropic.value.response.headers["retry-after"]
    body = refused_anthropic.value.response.json()
    assert body["type"] == "error" and "no engine replica is ready" in body["error"]["message"]


def test_session_api_stays_up_while_the_engine_restarts(
    server: LiveServer, double: EngineDouble
) -> None:
    before = server.create("before")
    assert _chat(server, "before", before).status_code == 200

    double.stop()  # the engine pod restarts: its port refuses connections
    _wait_engine(server, up=False)
    assert _ready(server)["store"] is True  # ready: stays behind its Service

    _assert_refused_in_every_shape(server, "before", before)
    during = server.create("during")  # POST /sessions needs no engine
    _assert_refused_in_every_shape(server, "during", during)
    with server.admin() as admin:
        trajectory = admin.get("/sessions/before/trajectory")
        assert trajectory.status_code == 200, trajectory.text
        assert admin.post("/sessions/before/finish", json={}).status_code == 200
        exported = admin.post("/sessions/export", json={"session_ids": ["before"]})
        assert exported.status_code == 200, exported.text
        rows = [line for line in exported.text.splitlines() if line]
        assert rows and all('"error"' not in row for row in rows)
        assert admin.get("/ui/api/sessions").status_code == 200
        assert admin.get("/ui/").status_code == 200
        metrics = admin.get("/metrics")
        assert metrics.status_code == 200 and "tokenkeep_" in metrics.text
    assert server.turns("before") == 1  # the refused turns stored nothing

    double.start()  # back on the same address
    _wait_engine(server, up=True)
    assert _chat(server, "during", during).status_code == 200

    double.healthy = False  # listening, but /health says it is loading its model
    _wait_engine(server, up=False)
    _assert_refused_in_every_shape(server, "during", during)
    strict = httpx.get(f"{server.url}/readyz", params={"engine": "true"}, timeout=5)
    assert strict.status_code == 503 and strict.json()["engine"] is False
    assert server.turns("during") == 1
