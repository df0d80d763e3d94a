"""A session's key reaches exactly its session, and a finished rollout is final, against live
`tokenkeep serve` processes (one alone, two sharing a real Redis) in front of the engine
double (it stands in for vLLM only, tests/engine_double.py).

Issue 33, class 1: the guard and the front-ends once read repeated headers differently (the
guard kept the last copy, the handlers the first), so session A's key with two X-Session-ID
headers was authorised for A and served for B; and a session deleted and created again
through one server kept its old metadata (old key, old sampling overrides) on another that
had cached it. Class 2: turns in flight at `finish`, and new turns after it, were stored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from session_server.app import build_service, create_app
from session_server.settings import Settings
from tests.api.stack import qwen3
from tests.engine_double import EngineDouble
from tests.real_tokenizers import qwen3_dir
from tests.security.conftest import (
    ADMIN_KEY,
    LiveServer,
    chat_body,
    in_thread,
    start_server,
    stop_server,
)

PROMPT_IDS = [9707, 11, 1879]
# Every turn API, bare (`/v1/...`: the session comes from the headers), with a body it serves.
TURN_APIS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", chat_body()),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": chat_body()["messages"]}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
    ("/v1/completions", {"model": "m", "prompt": PROMPT_IDS, "max_tokens": 5}),
    ("/inference/v1/generate", {"model": "m", "token_ids": PROMPT_IDS, "sampling_params": {}}),
]


def _sid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _trajectory(server: LiveServer, session_id: str) -> dict[str, Any]:
    with server.admin() as client:
        response = client.get(f"/sessions/{session_id}/trajectory")
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def pair(keyed: LiveServer) -> tuple[LiveServer, str, str]:
    """Two sessions with a turn each: (server, alice, bob)."""
    alice, bob = _sid("alice"), _sid("bob")
    for session_id in (alice, bob):
        keyed.create(session_id)
        with keyed.client(keyed.sessions[session_id]) as client:
            response = client.post(f"/sessions/{session_id}/v1/chat/completions", json=chat_body())
            assert response.status_code == 200, response.text
    return keyed, alice, bob


def _ambiguous_headers(alice: str, bob: str, alice_key: str) -> list[list[tuple[str, str]]]:
    """Header lists that name alice's credentials and bob's session, or two keys, in every
    order: each must be refused as ambiguous, never served for either session."""
    forged = f"tks-{'x' * 43}.{bob}"
    bearer = f"Bearer {alice_key}"
    return [
        [("authorization", bearer), ("x-session-id", alice), ("x-session-id", bob)],
        [("authorization", bearer), ("x-session-id", bob), ("x-session-id", alice)],
        [("authorization", bearer), ("authorization", f"Bearer {forged}")],
        [("authorization", f"Bearer {forged}"), ("authorization", bearer)],
        [("x-api-key", alice_key), ("x-api-key", forged)],
        [("x-api-key", forged), ("x-api-key", alice_key)],
        [("x-api-key", alice_key), ("authorization", f"Bearer {forged}")],
        [("authorization", f"Bearer {forged}"), ("x-api-key", alice_key)],
    ]


def test_repeated_credential_headers_are_refused_on_every_turn_api(
    pair: tuple[LiveServer, str, str],
) -> None:
    server, alice, bob = pair
    before = {sid: _trajectory(server, sid) for sid in (alice, bob)}
    alice_turns = server.turns(alice)
    calls = 0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, body in TURN_APIS:
            for headers in _ambiguous_headers(alice, bob, server.sessions[alice]):
                response = client.post(path, json=body, headers=headers)
                calls += 1
                assert response.status_code == 400, (path, headers, response.text)
                assert "Traceback" not in response.text
                assert "send one" in response.text, response.text
    assert calls == len(TURN_APIS) * 8
    assert {sid: _trajectory(server, sid) for sid in (alice, bob)} == before
    # The same copy twice is not ambiguous: served for alice.
    with httpx.Client(base_url=server.url, timeout=30) as client:
        key = server.sessions[alice]
        response = client.post(
            "/v1/chat/completions",
            json=chat_body(),
            headers=[("authorization", f"Bearer {key}"), ("x-session-id", alice)] * 2,
        )
    assert response.status_code == 200, response.text
    assert server.turns(alice) == alice_turns + 1
    assert _trajectory(server, bob) == before[bob]


def test_protected_mode_refuses_repeated_session_headers_too(protected: LiveServer) -> None:
    """No admin key (loopback clients need no credentials): two X-Session-ID headers still
    name no session rather than whichever copy a reader happens to take."""
    with httpx.Client(base_url=protected.url, timeout=30) as client:
        for path, body in TURN_APIS:
            response = client.post(
                path, json=body, headers=[("x-session-id", "p-one"), ("x-session-id", "p-two")]
            )
            assert response.status_code == 400, (path, response.text)
        for session_id in ("p-one", "p-two"):
            assert client.get(f"/sessions/{session_id}").status_code == 404


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, double: EngineDouble, redis_server: str
) -> Iterator[tuple[LiveServer, LiveServer]]:
    """Two session servers on one Redis, as a SessionServer with replicas: 2 runs them."""
    tmp = tmp_path_factory.mktemp("replicas")
    args = ("--admin-key", ADMIN_KEY, "--redis-url", redis_server)
    first = start_server(tmp, double, *args)
    try:
        second = start_server(tmp, double, *args)
        try:
            yield first, second
        finally:
            stop_server(second)
    finally:
        stop_server(first)


def _turn(server: LiveServer, session_id: str, key: str) -> httpx.Response:
    with server.client(key) as client:
        return client.post(f"/sessions/{session_id}/v1/chat/completions", json=chat_body())


def test_a_session_created_again_elsewhere_is_served_with_its_new_key_and_settings(
    replicas: tuple[LiveServer, LiveServer], double: EngineDouble
) -> None:
    one, two = replicas
    session_id = _sid("again")
    old_key = one.create(session_id, sampling={"temperature": 0.25})
    assert _turn(two, session_id, old_key).status_code == 200  # `two` caches the metadata
    assert double.requests[-1].sampling["temperature"] == 0.25

    with one.admin() as client:
        assert client.delete(f"/sessions/{session_id}").status_code in (200, 204)
    new_key = one.create(session_id, sampling={"temperature": 0.75})
    assert new_key != old_key
    sent = len(double.requests)

    refused = _turn(two, session_id, old_key)
    assert refused.status_code == 401, refused.text
    assert len(double.requests) == sent  # nothing generated for the revoked key
    assert one.turns(session_id) == 0

    served = _turn(two, session_id, new_key)
    assert served.status_code == 200, served.text
    assert double.requests[-1].sampling["temperature"] == 0.75
    assert one.turns(session_id) == 1
    # The admin through the server that cached the old session gets the new one's settings.
    with two.admin() as client:
        response = client.post(f"/sessions/{session_id}/v1/chat/completions", json=chat_body("x"))
    assert response.status_code == 200, response.text
    assert double.requests[-1].sampling["temperature"] == 0.75
    # And the old key stays refused once the new metadata is cached.
    assert _turn(two, session_id, old_key).status_code == 401
    assert two.turns(session_id) == 2


def test_the_admin_gets_a_recreated_sessions_settings_on_a_server_that_cached_the_old(
    replicas: tuple[LiveServer, LiveServer], double: EngineDouble
) -> None:
    one, two = replicas
    session_id = _sid("admin-again")
    one.create(session_id, sampling={"temperature": 0.25})
    with two.admin() as client:
        url = f"/sessions/{session_id}/v1/chat/completions"
        assert client.post(url, json=chat_body()).status_code == 200
        with one.admin() as other:
            assert other.delete(f"/sessions/{session_id}").status_code in (200, 204)
        one.create(session_id, sampling={"temperature": 0.5})
        response = client.post(url, json=chat_body())
    assert response.status_code == 200, response.text
    assert double.requests[-1].sampling["temperature"] == 0.5
    assert one.turns(session_id) == 1


def test_a_finished_rollout_takes_no_more_turns(
    pair: tuple[LiveServer, str, str], double: EngineDouble
) -> None:
    server, _, _ = pair
    session_id = _sid("done")
    key = server.create(session_id)
    assert _turn(server, session_id, key).status_code == 200
    with server.admin() as client:
        finished = client.post(f"/sessions/{session_id}/finish", json={"reward": 1.0})
    assert finished.status_code == 200, finished.text
    assert finished.json()["in_flight_cut"] == 0
    at_finish = _trajectory(server, session_id)
    sent = len(double.requests)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, body in TURN_APIS:
            response = client.post(path, json=body, headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 409, (path, response.text)
            assert "finished" in response.text
    assert len(double.requests) == sent  # refused before the engine
    assert _trajectory(server, session_id) == at_finish


def _in_flight(
    server: LiveServer, double: EngineDouble, session_id: str, key: str
) -> Callable[[], httpx.Response]:
    """A turn of the session sent from a thread; returns once the engine has it (the caller
    has made the double slow), with the function that waits for its answer."""
    sent = len(double.requests)
    pending = in_thread(
        lambda: httpx.post(
            f"{server.url}/sessions/{session_id}/v1/chat/completions",
            json=chat_body("again"),
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )
    )
    deadline = time.monotonic() + 10
    while len(double.requests) == sent and time.monotonic() < deadline:
        time.sleep(0.02)
    return pending


def _while_in_flight(
    server: LiveServer, double: EngineDouble, session_id: str, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, Any, httpx.Response]:
    """A session with one stored turn and a second in flight (the double made slow): the
    admin's `POST /sessions/{id}/{path}` meanwhile. Returns its answer, the trajectory just
    after it, and the in-flight turn's answer."""
    key = server.create(session_id)
    assert _turn(server, session_id, key).status_code == 200
    double.latency_s = 3.0
    try:
        pending = _in_flight(server, double, session_id, key)
        with server.admin() as client:
            called = client.post(f"/sessions/{session_id}/{path}", json=body)
        after = _trajectory(server, session_id)
        return called, after, pending()
    finally:
        double.latency_s = 0.0


def test_a_turn_in_flight_at_finish_is_cut_and_not_stored(
    pair: tuple[LiveServer, str, str], double: EngineDouble
) -> None:
    server, _, _ = pair
    session_id = _sid("inflight")
    finished, at_finish, answer = _while_in_flight(
        server, double, session_id, "finish", {"reward": 0.5}
    )
    assert finished.status_code == 200, finished.text
    assert finished.json()["in_flight_cut"] == 1
    assert answer.status_code == 409, answer.text
    assert "finished" in answer.text
    assert server.turns(session_id) == 1
    assert _trajectory(server, session_id) == at_finish
    # A second finish, and an abort that would finish, change nothing and cut nothing.
    with server.admin() as client:
        again = client.post(f"/sessions/{session_id}/abort", json={"finish": True})
        assert again.status_code == 409, again.text
        assert client.post(f"/sessions/{session_id}/finish", json={}).status_code == 409
    assert _trajectory(server, session_id) == at_finish


def test_abort_with_finish_freezes_before_it_cuts(
    pair: tuple[LiveServer, str, str], double: EngineDouble
) -> None:
    """`abort {"finish": true}` is a finish: the turn it cuts is refused like one cut by
    finish (409, nothing stored). Cutting first stored the cut turn before the freeze, and
    racing a finish it answered 409 after cutting (issue 33, class 5)."""
    server, _, _ = pair
    session_id = _sid("abort-finish")
    aborted, at_finish, answer = _while_in_flight(
        server, double, session_id, "abort", {"finish": True}
    )
    assert aborted.status_code == 200, aborted.text
    assert aborted.json()["aborted"] == 1
    assert aborted.json()["finish"]["status"] == "aborted"
    assert answer.status_code == 409, answer.text
    assert "finished" in answer.text
    assert server.turns(session_id) == 1
    assert _trajectory(server, session_id) == at_finish


async def test_a_wrong_key_costs_one_store_read_whether_or_not_its_session_exists(
    double: EngineDouble,
) -> None:
    """An invented key once told, by its answer time, whether its session id existed (a
    cached session refused it at once; an unknown one cost a store read). Now each wrong
    key is checked against the store exactly once either way, and refused alike. In-process
    (the store's reads are counted); the double stands in for vLLM only."""
    settings = Settings(
        engine_urls=[double.url],
        model=double.model,
        tokenizer=str(qwen3_dir()),
        context_length=double.max_model_len,
        admin_key=ADMIN_KEY,
    )
    service = build_service(settings, model=qwen3())
    reads: list[str] = []
    real = service.store.get_session

    async def counted(session_id: str) -> Any:
        reads.append(session_id)
        return await real(session_id)

    service.store.get_session = counted  # type: ignore[method-assign]
    transport = httpx.ASGITransport(app=create_app(settings, service))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        created = await client.post(
            "/sessions", json={"id": "exists"}, headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert created.status_code == 201, created.text
        key = created.json()["api_key"]
        assert (
            await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        ).is_success
        answers = {}
        for session_id in ("exists", "never-existed"):
            reads.clear()
            forged = f"tks-{'x' * 43}.{session_id}"
            response = await client.post(
                f"/sessions/{session_id}/v1/chat/completions",
                json=chat_body(),
                headers={"authorization": f"Bearer {forged}"},
            )
            answers[session_id] = (response.status_code, response.json(), list(reads))
    assert answers["exists"][0] == answers["never-existed"][0] == 401
    assert answers["exists"][1] == answers["never-existed"][1]
    assert answers["exists"][2] == ["exists"]
    assert answers["never-existed"][2] == ["never-existed"]
