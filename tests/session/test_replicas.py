"""Two session servers sharing one Redis: retries and Idempotency-Key resends never split a
rollout across replicas, and a session deleted through one replica is refused at once by
the other (no stale metadata accepted)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from session_server.app import build_service, create_app
from session_server.engines import EngineClient
from session_server.settings import Settings
from session_server.splice import ChatModel
from session_server.store.redis import RedisStore
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.live_server import serving
from tests.session.adversarial import END, tokens

USER = [{"role": "user", "content": "Name a colour."}]
ADMIN = "admin-key-for-replica-tests"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def replicas(
    qwen3_model: ChatModel, engine_double: EngineDouble, redis_server: str
) -> Iterator[list[str]]:
    prefix = f"t{uuid.uuid4().hex[:12]}"
    settings = Settings(
        engine_urls=[engine_double.url],
        model=engine_double.model,
        tokenizer=str(qwen3_model.tokenizer.name_or_path),
        context_length=engine_double.max_model_len,
        admin_key=ADMIN,
    )
    apps = [
        create_app(
            settings,
            build_service(
                settings,
                store=RedisStore(redis_server, key_prefix=prefix),
                model=qwen3_model,
                engine=EngineClient([engine_double.url], model=engine_double.model),
            ),
        )
        for _ in range(2)
    ]
    with serving(apps[0]) as a, serving(apps[1]) as b:
        yield [a, b]


def _chat(
    url: str, session_id: str, key: str | None = None, credential: str = ADMIN
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {credential}"}
    if key:
        headers["Idempotency-Key"] = key
    with httpx.Client(base_url=url, timeout=30) as client:
        return client.post(
            f"/sessions/{session_id}/v1/chat/completions",
            json={"model": "m", "messages": USER},
            headers=headers,
        )


def test_concurrent_resends_through_two_replicas_are_one_root(
    replicas: list[str], qwen3_model: ChatModel, engine_double: EngineDouble
) -> None:
    engine_double.script(*(ScriptedCompletion(tokens(qwen3_model, f"C{i}", END)) for i in range(6)))
    engine_double.latency_s = 0.4
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: _chat(replicas[i % 2], "x"), range(6)))
    finally:
        engine_double.latency_s = 0.0
    assert sorted(a.json()["tokenkeep"]["kind"] for a in answers) == ["first"] + ["retry"] * 5
    with httpx.Client(base_url=replicas[0], headers=AS_ADMIN) as client:
        assert client.get("/sessions/x").json()["turns_by_kind"] == {"first": 1, "retry": 5}


def test_idempotency_key_resend_through_another_replica_waits_for_the_first(
    replicas: list[str], qwen3_model: ChatModel, engine_double: EngineDouble
) -> None:
    engine_double.script(ScriptedCompletion(tokens(qwen3_model, "Teal", END)))
    engine_double.latency_s = 0.6
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: _chat(replicas[i % 2], "k", "key-1"), range(4)))
    finally:
        engine_double.latency_s = 0.0
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1 and len(engine_double.requests) == 1
    with httpx.Client(base_url=replicas[1], headers=AS_ADMIN) as client:
        assert client.get("/sessions/k").json()["turns"] == 1


def test_a_session_deleted_through_one_replica_is_refused_by_the_other(
    replicas: list[str], qwen3_model: ChatModel, engine_double: EngineDouble
) -> None:
    a, b = replicas
    with httpx.Client(base_url=a, headers=AS_ADMIN) as client:
        session = client.post("/sessions", json={"id": "gone"}).json()
    engine_double.script(ScriptedCompletion(tokens(qwen3_model, "Hi", END)))
    key = session["api_key"]
    # b now holds the session's metadata, and has checked the key against it
    assert _chat(b, "gone", credential=key).status_code == 200
    with httpx.Client(base_url=a, headers=AS_ADMIN) as client:
        assert client.delete("/sessions/gone").status_code == 204
    refused = _chat(b, "gone", credential=key)
    assert refused.status_code == 404, refused.text
    with httpx.Client(base_url=b, headers=AS_ADMIN) as client:
        assert client.get("/sessions/gone").status_code == 404  # nothing re-created
    # The admin reaching the id afterwards gets a new session, as for any unknown id.
    engine_double.script(ScriptedCompletion(tokens(qwen3_model, "Hi", END)))
    again = _chat(b, "gone")
    assert again.status_code == 200, again.text
    assert again.json()["tokenkeep"]["kind"] == "first"
