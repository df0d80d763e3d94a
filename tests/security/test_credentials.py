"""Credentials by role, against a live server through the official SDKs: a session's key
opens that session's model APIs and nothing else, the admin key opens everything,
`tk-<id>` is a credential only where the operator opted in, probes need nothing, and a
refused request changes no session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from session_server.app import create_app
from session_server.settings import Settings
from tests.engine_double import EngineDouble
from tests.real_tokenizers import qwen3_dir
from tests.security.conftest import (
    ADMIN_KEY,
    LiveServer,
    chat_body,
    start_server,
    stop_server,
)

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def two_sessions(keyed: LiveServer) -> LiveServer:
    for session_id in ("alice", "bob"):
        keyed.create(session_id)
        with keyed.client(keyed.sessions[session_id]) as client:
            response = client.post(f"/sessions/{session_id}/v1/chat/completions", json=chat_body())
            assert response.status_code == 200, response.text
    return keyed


def _openai(server: LiveServer, session_id: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/sessions/{session_id}/v1", api_key=key, max_retries=0
    )


def _anthropic(server: LiveServer, session_id: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"{server.url}/sessions/{session_id}", api_key=key, max_retries=0
    )


def test_session_key_opens_its_own_session_through_both_sdks(two_sessions: LiveServer) -> None:
    key = two_sessions.sessions["alice"]
    assert key.startswith("tks-") and "alice" in key
    reply = _openai(two_sessions, "alice", key).chat.completions.create(
        model="m", messages=MESSAGES
    )
    assert reply.choices[0].message.content == "ok"
    message = _anthropic(two_sessions, "alice", key).messages.create(
        model="m", max_tokens=5, messages=MESSAGES
    )
    assert message.content[0].text == "ok"  # type: ignore[union-attr]
    # The key alone names the session: a harness that sets only a base URL and a key.
    bare = openai.OpenAI(base_url=f"{two_sessions.url}/v1", api_key=key, max_retries=0)
    assert bare.chat.completions.create(model="m", messages=MESSAGES).choices[0].message


def test_session_key_cannot_touch_another_session(two_sessions: LiveServer) -> None:
    key = two_sessions.sessions["alice"]
    before = two_sessions.turns("bob")
    with pytest.raises(openai.PermissionDeniedError) as denied:
        _openai(two_sessions, "bob", key).chat.completions.create(model="m", messages=MESSAGES)
    assert denied.value.body["type"] == "permission_error"  # type: ignore[index]
    with pytest.raises(anthropic.PermissionDeniedError) as refused:
        _anthropic(two_sessions, "bob", key).messages.create(
            model="m", max_tokens=5, messages=MESSAGES
        )
    assert refused.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    by_header = openai.OpenAI(
        base_url=f"{two_sessions.url}/v1",
        api_key=key,
        default_headers={"X-Session-ID": "bob"},
        max_retries=0,
    )
    with pytest.raises(openai.PermissionDeniedError):
        by_header.chat.completions.create(model="m", messages=MESSAGES)
    with two_sessions.client(key) as client:
        for method, path in [
            ("DELETE", "/sessions/bob"),
            ("GET", "/sessions/bob/trajectory"),
            ("GET", "/sessions/alice/trajectory"),
            ("GET", "/sessions/alice"),
            ("DELETE", "/sessions/alice"),
        ]:
            response = client.request(method, path)
            assert response.status_code == 403, (method, path, response.text)
            assert response.json()["error"]["type"] == "permission_error"
        response = client.post("/sessions", json={"id": "mallory"})
        assert response.status_code == 403
    assert two_sessions.turns("bob") == before
    assert two_sessions.turns("alice") >= 1


def test_generate_route_is_guarded_like_the_model_apis(two_sessions: LiveServer) -> None:
    """vLLM's token-in route (verifiers' TrainClient) at a session URL and bare."""
    key = two_sessions.sessions["alice"]
    body = {"model": "m", "token_ids": [9707, 11, 1879], "sampling_params": {"max_tokens": 5}}
    before = two_sessions.turns("bob")
    alice = two_sessions.turns("alice")
    with two_sessions.client(key) as client:
        own = client.post("/sessions/alice/inference/v1/generate", json=body)
        assert own.status_code == 200, own.text
        bare = client.post("/inference/v1/generate", json=body)  # the key names the session
        assert bare.status_code == 200, bare.text
        for path, headers in [
            ("/sessions/bob/inference/v1/generate", {}),
            ("/inference/v1/generate", {"X-Session-ID": "bob"}),
        ]:
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 403, (path, response.text)
            assert response.json()["error"]["type"] == "permission_error"
    with httpx.Client(base_url=two_sessions.url) as anonymous:
        response = anonymous.post("/sessions/alice/inference/v1/generate", json=body)
        assert response.status_code == 401, response.text
    assert two_sessions.turns("bob") == before
    assert two_sessions.turns("alice") == alice + 2


def test_wrong_missing_and_derived_keys_are_refused(two_sessions: LiveServer) -> None:
    before = two_sessions.turns("alice")
    alice = two_sessions.sessions["alice"]
    forged = alice[: -len(".alice")][:-4] + "AAAA.alice"
    for key in ("tk-alice", "wrong", forged, alice.replace(".alice", ".bob")):
        with pytest.raises(openai.AuthenticationError) as denied:
            _openai(two_sessions, "alice", key).chat.completions.create(
                model="m", messages=MESSAGES
            )
        assert denied.value.body["type"] == "authentication_error"  # type: ignore[index]
        with pytest.raises(anthropic.AuthenticationError) as refused:
            _anthropic(two_sessions, "alice", key).messages.create(
                model="m", max_tokens=5, messages=MESSAGES
            )
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with httpx.Client(base_url=two_sessions.url) as client:
        response = client.post("/sessions", json={})
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"
        response = client.post("/sessions/alice/v1/messages", json={})
        assert response.status_code == 401
        assert response.json() == {
            "type": "error",
            "error": {
                "type": "authentication_error",
                "message": response.json()["error"]["message"],
            },
        }
    assert two_sessions.turns("alice") == before


def test_admin_key_opens_everything_and_probes_need_nothing(two_sessions: LiveServer) -> None:
    with two_sessions.admin() as admin:
        assert admin.get("/sessions/bob/trajectory").status_code == 200
        response = admin.post(
            "/v1/chat/completions", json=chat_body("hello"), headers={"X-Session-ID": "bob"}
        )
        assert response.status_code == 200, response.text
        # First use with the admin key may create a session (trusted caller).
        response = admin.post(
            "/v1/chat/completions", json=chat_body(), headers={"X-Session-ID": "admin-made"}
        )
        assert response.status_code == 200, response.text
    with httpx.Client(base_url=two_sessions.url) as anyone:
        assert anyone.get("/healthz").status_code == 200
        assert anyone.get("/readyz").status_code == 200
        assert anyone.get("/metrics").status_code == 200


def test_a_deleted_sessions_key_dies_with_it(keyed: LiveServer) -> None:
    key = keyed.create("short-lived")
    with keyed.client(key) as client:
        assert (
            client.post("/sessions/short-lived/v1/chat/completions", json=chat_body()).status_code
            == 200
        )
    with keyed.admin() as admin:
        assert admin.delete("/sessions/short-lived").status_code == 204
    with keyed.client(key) as client:
        response = client.post("/sessions/short-lived/v1/chat/completions", json=chat_body())
        assert response.status_code == 401
    with keyed.admin() as admin:
        assert admin.get("/sessions/short-lived").status_code == 404


@pytest.fixture(scope="module")
def id_keys(tmp_path_factory: pytest.TempPathFactory, double: EngineDouble) -> Iterator[LiveServer]:
    server = start_server(
        tmp_path_factory.mktemp("idkeys"), double, "--admin-key", ADMIN_KEY, "--session-id-keys"
    )
    try:
        yield server
    finally:
        stop_server(server)


def test_tk_id_keys_only_when_opted_in(id_keys: LiveServer) -> None:
    """Trusted setups: `tk-<id>` opens (and may create) that session, and only that one."""
    reply = _anthropic(id_keys, "trusted", "tk-trusted").messages.create(
        model="m", max_tokens=5, messages=MESSAGES
    )
    assert reply.content[0].text == "ok"  # type: ignore[union-attr]
    with pytest.raises(anthropic.PermissionDeniedError):
        _anthropic(id_keys, "other", "tk-trusted").messages.create(
            model="m", max_tokens=5, messages=MESSAGES
        )
    with id_keys.client("tk-trusted") as client:
        assert client.get("/sessions/trusted/trajectory").status_code == 403
    assert id_keys.turns("trusted") == 1
    assert "tk-<session id> keys accepted" in id_keys.log.read_text()


def test_protected_mode_answers_loopback_without_credentials(protected: LiveServer) -> None:
    with httpx.Client(base_url=protected.url) as client:
        created = client.post("/sessions", json={"id": "dev"})
        assert created.status_code == 201
        response = client.post("/sessions/dev/v1/chat/completions", json=chat_body())
        assert response.status_code == 200
        assert client.get("/sessions/dev/trajectory").status_code == 200
    log = protected.log.read_text()
    assert log.count("protected mode") == 1


def test_serve_refuses_a_public_address_without_keys(tmp_path: Path, double: EngineDouble) -> None:
    """Nothing is bound: the check comes before listening."""
    with pytest.raises(RuntimeError, match=r"refusing to listen on 0\.0\.0\.0"):
        start_server(tmp_path, double, "--host", "0.0.0.0")


def test_viewer_pages_open_its_data_behind_the_admin_key(two_sessions: LiveServer) -> None:
    """A browser loads the viewer before it can be given a key; the sessions it shows are
    the export's data, so they need the admin key (a session key is not enough)."""
    with two_sessions.client() as anonymous:
        assert anonymous.get("/ui/").status_code == 200
        assert anonymous.get("/ui/sessions/alice").status_code == 200
        assert anonymous.get("/ui/static/viewer.js").status_code == 200
        assert anonymous.get("/ui/api/sessions").status_code == 401
        assert anonymous.get("/ui/api/sessions/alice").status_code == 401
    with two_sessions.client(two_sessions.sessions["alice"]) as session_key:
        assert session_key.get("/ui/api/sessions/alice").status_code == 403
    with two_sessions.admin() as admin:
        listed = admin.get("/ui/api/sessions").json()["sessions"]
        assert {"alice", "bob"} <= {s["id"] for s in listed}
        shown = admin.get("/ui/api/sessions/alice").json()
        assert shown["turns"] == two_sessions.turns("alice") >= 1


@pytest.mark.parametrize("insecure", [False, True])
async def test_protected_mode_refuses_clients_that_are_not_loopback(
    double: EngineDouble, insecure: bool
) -> None:
    """A remote peer cannot be made on loopback, so this one runs the app in-process with
    the ASGI client address a remote peer would have."""
    settings = Settings(
        engine_urls=[double.url],
        model=double.model,
        tokenizer=str(qwen3_dir()),
        context_length=double.max_model_len,
        insecure=insecure,
    )
    transport = httpx.ASGITransport(app=create_app(settings), client=("192.0.2.7", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as remote:
        assert (await remote.get("/healthz")).status_code == 200
        response = await remote.post("/sessions", json={"id": "remote"})
        if insecure:
            assert response.status_code == 201
        else:
            assert response.status_code == 403
            assert response.json()["error"]["type"] == "permission_error"
            assert "protected mode" in response.json()["error"]["message"]
