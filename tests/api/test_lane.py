"""The turn requests' lane (session_server/api/lane.py) serves the turn routes in front of
FastAPI: what users get from them must not change. Real HTTP through the real app (uvicorn on
a loopback port, the engine double behind it), and the same requests through FastAPI's own
stack compared byte for byte."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from session_server.api import chat
from session_server.api.lane import Lane, LanedFastAPI
from session_server.app import build_service, create_app
from session_server.settings import Settings
from tests.api.stack import qwen3
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.live_server import serving
from tests.raw_http import connect, read_response
from tests.real_tokenizers import qwen3_dir

OK_REPLY = [562, 151645]
"""Qwen3 tokens of "ok" and <|im_end|>."""
LIMIT = 4096
ADMIN = "admin-" + "k" * 40
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
TURN_PATHS = [
    "/sessions/s/v1/chat/completions",
    "/v1/chat/completions",
    "/sessions/s/v1/messages",
    "/v1/messages",
    "/sessions/s/v1/messages/count_tokens",
    "/v1/messages/count_tokens",
    "/sessions/s/v1/responses",
    "/v1/responses",
    "/sessions/s/v1/completions",
    "/v1/completions",
    "/sessions/s/inference/v1/generate",
    "/inference/v1/generate",
]


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    double = EngineDouble().start()
    double.default = lambda _prompt, _sampling: ScriptedCompletion(list(OK_REPLY))
    try:
        yield double
    finally:
        double.stop()


def _app(double: EngineDouble, **settings: Any) -> LanedFastAPI:
    config = Settings(
        engine_urls=[double.url],
        model=double.model,
        tokenizer=str(qwen3_dir()),
        max_body_bytes=LIMIT,
        **settings,
    )
    app = create_app(config, build_service(config, model=qwen3()))
    assert isinstance(app, LanedFastAPI)
    return app


@pytest.fixture(scope="module")
def app(double: EngineDouble) -> LanedFastAPI:
    return _app(double)


@pytest.fixture(scope="module")
def url(app: LanedFastAPI) -> Iterator[str]:
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(double: EngineDouble) -> Iterator[str]:
    with serving(_app(double, admin_key=ADMIN)) as url:
        yield url


def _scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}


class FastAPIStack:
    """The app as FastAPI alone serves it (the lane bypassed): what the lane must match."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await FastAPI.__call__(self.app, scope, receive, send)


@pytest.mark.parametrize("path", TURN_PATHS)
def test_the_lane_takes_the_turn_routes_by_method_and_path(app: LanedFastAPI, path: str) -> None:
    lane = app.lane()
    served = lane.match(_scope("POST", path))
    assert served is not None
    route, params = served
    assert route.path == path.replace("/sessions/s/", "/sessions/{session_id}/")
    assert params == ({"session_id": "s"} if path.startswith("/sessions/") else {})
    assert lane.match(_scope("GET", path)) is None
    assert lane.match(_scope("POST", path + "/")) is None


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", "/sessions/s/v1/models"),
        ("POST", "/sessions"),
        ("POST", "/sessions/s/finish"),
        ("POST", "/sessions/export"),
        ("GET", "/sessions/s"),
        ("POST", "/tokenize"),
        ("GET", "/healthz"),
        ("POST", "/sessions/a/b/v1/chat/completions"),
        ("POST", "/sessions//v1/chat/completions"),
    ],
)
def test_every_other_request_is_left_to_fastapi(app: LanedFastAPI, method: str, path: str) -> None:
    assert app.lane().match(_scope(method, path)) is None


def test_with_fastapis_opentelemetry_on_every_request_keeps_fastapis_path(
    double: EngineDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FastAPI's own spans (its native telemetry) wrap only requests it routes."""
    app = _app(double)
    monkeypatch.setattr(app._native_telemetry, "enabled", lambda: True)
    assert all(app.lane().match(_scope("POST", path)) is None for path in TURN_PATHS)


def test_a_fastapi_body_limit_keeps_its_routes_on_fastapis_path(
    double: EngineDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app(double)
    monkeypatch.setattr(app, "max_body_size", LIMIT, raising=False)
    assert all(app.lane().match(_scope("POST", path)) is None for path in TURN_PATHS)


def test_the_turn_routes_stay_in_the_openapi_schema(url: str) -> None:
    paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    for path in TURN_PATHS:
        declared = path.replace("/sessions/s/", "/sessions/{session_id}/")
        assert "post" in paths[declared], declared
    chat_body = paths["/sessions/{session_id}/v1/chat/completions"]["post"]["requestBody"]
    assert chat_body["content"]["application/json"]["schema"]["$ref"].endswith(
        "ChatCompletionRequest"
    )


# Refusals and errors: the same bytes through the lane as through FastAPI's stack.
ERRORS = [
    ("/sessions/e/v1/chat/completions", {"model": "m"}),
    ("/sessions/e/v1/messages", {"model": "m", "messages": 3}),
    ("/sessions/e/v1/messages/count_tokens", {"messages": "x"}),
    ("/sessions/e/v1/responses", {"input": 5}),
    ("/sessions/e/v1/completions", {"prompt": [1], "n": 0}),
    ("/sessions/e/inference/v1/generate", {"token_ids": []}),
    ("/sessions/e/v1/chat/completions", b"{not json"),
    ("/sessions/e/v1/messages", b"{not json"),
    ("/sessions/e/v1/chat/completions", b""),
    ("/sessions/e/v1/chat/completions", [1]),
    ("/v1/chat/completions", CHAT),
    ("/v1/messages", MESSAGES),
    ("/sessions/bad%20id/v1/chat/completions", CHAT),
    ("/sessions/" + "x" * 200 + "/v1/messages", MESSAGES),
    ("/sessions/e/v1/chat/completions", b"x" * (LIMIT + 1)),
]


@pytest.mark.parametrize(("path", "body"), ERRORS)
async def test_errors_are_the_same_bytes_as_through_fastapi(
    app: LanedFastAPI, path: str, body: Any
) -> None:
    answers = []
    for served in (app, FastAPIStack(app)):
        transport = httpx.ASGITransport(app=served)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            if isinstance(body, bytes):
                response = await client.post(path, content=body)
            else:
                response = await client.post(path, json=body)
        answers.append((response.status_code, response.headers.multi_items(), response.content))
    assert answers[0] == answers[1]
    assert answers[0][0] in (400, 413)


def test_validation_errors_in_each_apis_shape(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        anthropic = client.post("/sessions/e/v1/messages", json={"model": "m", "messages": 3})
        openai = client.post("/sessions/e/v1/responses", json={"input": 5})
    assert anthropic.status_code == 400
    assert anthropic.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages: Input should be a valid array",
        },
    }
    assert openai.status_code == 400
    assert openai.json()["error"] == {
        "message": "input: Input should be a valid array",
        "type": "invalid_request_error",
        "param": "input",
        "code": 400,
    }


def test_a_turn_through_the_lane_is_logged_and_counted(
    app: LanedFastAPI, url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="tokenkeep.requests")
    served = []
    monkeypatch.setattr(Lane, "__call__", _counted(Lane.__call__, served))
    before = _requests(app, "chat", "200")
    with httpx.Client(base_url=url, timeout=30) as client:
        response = client.post("/sessions/logged/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    assert response.json()["choices"][0]["message"]["content"] == "ok"
    line = _access_line(caplog, "/sessions/logged/v1/chat/completions")
    assert line | {"ms": 0} == {
        "method": "POST",
        "path": "/sessions/logged/v1/chat/completions",
        "status": 200,
        "ms": 0,
        "session": "logged",
        "api": "chat",
        "kind": "first",
    }
    deadline = time.monotonic() + 10  # counted right after the line, on the server's thread
    while _requests(app, "chat", "200") != before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _requests(app, "chat", "200") == before + 1
    assert served == ["/sessions/logged/v1/chat/completions"]


def _access_line(caplog: pytest.LogCaptureFixture, path: str) -> dict[str, Any]:
    """The access-log line of the request to `path`. It is written once the answer is sent,
    so a client may read the answer first: wait for it."""
    deadline = time.monotonic() + 10
    while True:
        lines = [
            json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenkeep.requests"
        ]
        found = [x for x in lines if x["path"] == path]
        if found or time.monotonic() > deadline:
            assert found, f"no access-log line for {path}"
            return found[-1]
        time.sleep(0.01)


def _counted(call: Any, served: list[str]) -> Any:
    async def counted(lane: Lane, scope: Scope, *args: Any) -> None:
        served.append(scope["path"])
        await call(lane, scope, *args)

    return counted


def test_an_error_names_itself_in_the_log_line(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenkeep.requests")
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/sessions/e/v1/completions", json={"prompt": [1], "n": 0}).is_error
    line = _access_line(caplog, "/sessions/e/v1/completions")
    assert (line["status"], line["error"]) == (400, "n: Input should be greater than or equal to 1")


def test_a_streamed_turn_through_the_lane(url: str) -> None:
    with (
        httpx.Client(base_url=url, timeout=30) as client,
        client.stream(
            "POST", "/sessions/streamed/v1/messages", json=MESSAGES | {"stream": True}
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = [
        line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event")
    ]
    assert events[0] == "message_start"
    assert events[-1] == "message_stop"
    assert '"text":"ok"' in text


def test_non_turn_routes_are_still_served_by_fastapi(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/v1/models").json()["object"] == "list"
        assert client.post("/sessions", json={"id": "made"}).status_code == 201
        assert client.get("/sessions/made").json()["id"] == "made"
        wrong_method = client.get("/sessions/s/v1/chat/completions")
        assert wrong_method.status_code == 405
        assert client.post("/sessions/s/v1/nothing", json=CHAT).status_code == 404
        slash = client.post("/sessions/s/v1/chat/completions/", json=CHAT)
        assert slash.status_code == 307


def test_an_unexpected_exception_gets_starlettes_500_and_is_logged(
    app: LanedFastAPI, url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("broken")

    monkeypatch.setattr(app.state.turns, "complete", broken)
    caplog.set_level(logging.INFO)
    # Every uvicorn.Config sets uvicorn.error's level, the engine double's to CRITICAL: say
    # which level this test reads rather than inherit the last server started.
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    server_log = logging.getLogger("uvicorn.error")  # it does not propagate to the root
    server_log.addHandler(caplog.handler)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            response = client.post("/sessions/boom/v1/chat/completions", json=CHAT)
    finally:
        server_log.removeHandler(caplog.handler)
    assert (response.status_code, response.text) == (500, "Internal Server Error")
    assert _access_line(caplog, "/sessions/boom/v1/chat/completions")["status"] == 500
    errors = [r for r in caplog.records if r.name == "uvicorn.error" and r.exc_info]
    assert errors[-1].getMessage() == "Exception in ASGI application\n"
    assert str(errors[-1].exc_info[1]) == "broken"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/sessions/late/v1/chat/completions", CHAT),
        ("/sessions/late/inference/v1/generate", {"token_ids": [1, 2, 3]}),
    ],
)
def test_a_draining_server_refuses_turns_and_closes_connections(
    app: LanedFastAPI, url: str, monkeypatch: pytest.MonkeyPatch, path: str, body: Any
) -> None:
    monkeypatch.setattr(app.state.admission, "draining", True)
    with httpx.Client(base_url=url, timeout=30) as client:
        refused = client.post(path, json=body)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["connection"] == "close"
    assert refused.json()["error"]["message"] == "the server is shutting down; retry"


def test_an_oversized_chunked_body_gets_413_in_the_apis_shape(url: str) -> None:
    chunk = b" " * (LIMIT + 1)
    with connect(url) as sock:
        sock.sendall(
            b"POST /sessions/big/v1/messages HTTP/1.1\r\nhost: t\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(chunk):x}\r\n".encode()
            + chunk
            + b"\r\n"
        )
        status, headers, body = read_response(sock)
    assert status == 413
    assert headers["connection"] == "close"
    assert json.loads(body) == {
        "type": "error",
        "error": {
            "type": "request_too_large",
            "message": f"request body larger than this server's limit of {LIMIT} bytes",
        },
    }


@pytest.mark.parametrize(("key", "status"), [(None, 401), ("tks-wrong.s", 401), ("tk-s", 401)])
def test_credentials_are_refused_before_the_body_is_read(
    keyed_url: str, key: str | None, status: int
) -> None:
    auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
    with connect(keyed_url) as sock:
        # The declared body is never sent: the answer must not wait for it.
        sock.sendall(
            b"POST /sessions/s/v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
            b"content-type: application/json\r\ncontent-length: 1000\r\n" + auth + b"\r\n"
        )
        answered, headers, body = read_response(sock)
    assert answered == status
    assert headers["www-authenticate"].lower().startswith("bearer")
    assert json.loads(body)["error"]["type"] == "authentication_error"


def test_a_session_key_opens_only_its_own_session_through_the_lane(keyed_url: str) -> None:
    admin = {"authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=keyed_url, timeout=30) as client:
        key = client.post("/sessions", json={"id": "mine"}, headers=admin).json()["api_key"]
        client.post("/sessions", json={"id": "theirs"}, headers=admin)
        own = client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": key})
        other = client.post(
            "/sessions/theirs/v1/chat/completions", json=CHAT, headers={"x-api-key": key}
        )
    assert own.status_code == 200
    assert own.json()["choices"][0]["message"]["content"] == "ok"
    assert other.status_code == 403
    assert other.json()["error"]["message"] == "this API key opens only its own session"


async def test_the_endpoint_gets_the_request_fastapi_would_give_it(
    app: LanedFastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, Any]] = []

    async def capture(session_id: str, body: Any, request: Any) -> dict[str, Any]:
        request.state.api = "chat"
        seen.append(
            {
                "session_id": session_id,
                "body": body.model_dump(),
                "raw": await request.body(),
                "headers": dict(request.headers),
                "path_params": request.path_params,
                "url": str(request.url),
                "app": request.app,
                "state": dict(request.scope["state"]),
                "scope": {
                    key: request.scope[key]
                    for key in ("path", "method", "client", "route", "endpoint", "router")
                },
            }
        )
        return {"ok": True}

    monkeypatch.setattr(chat, "_serve", capture)
    replies = []
    for served in (app, FastAPIStack(app)):
        transport = httpx.ASGITransport(app=served)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.post(
                "/sessions/same/v1/chat/completions", json=CHAT, headers={"x-extra": "1"}
            )
        replies.append((response.status_code, response.headers.multi_items(), response.content))
    assert replies[0] == replies[1]
    assert seen[0]["state"].pop("arrived") > 0
    assert seen[1]["state"].pop("arrived") > 0
    assert seen[0] == seen[1]


def _requests(app: LanedFastAPI, api: str, status: str) -> float:
    registry = app.state.turns.metrics.registry
    value = registry.get_sample_value("tokenkeep_requests_total", {"api": api, "status": status})
    return value or 0.0
