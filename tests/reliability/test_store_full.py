"""Redis full (issue 35, item 8): a live `tokenkeep serve` on a real redis-server with a small
`maxmemory`, `noeviction` and a password (given apart from the URL, as the operator does).
Once Redis is full a turn is refused with a clean, retryable 503 in its API's shape, every
turn acknowledged before is still there, the server stays ready, /metrics says how full Redis
is and how many writes it refused (and GET /policy, which the operator reads, gives it the
numbers for the SessionServer's StoreFull condition), and turns are served again once memory
is freed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.engine_double import EngineDouble, ScriptedCompletion, running_doubles
from tests.redis_server import start_redis_server, stop_redis_server
from tests.security.conftest import ADMIN_KEY, OK_REPLY, LiveServer, start_server, stop_server
from tokenkeep_operator.status import server_conditions

PASSWORD = "p" * 32
MAXMEMORY = 8 * 1024 * 1024
SESSIONS = 60
# A few thousand tokens per first turn: each stored turn costs Redis some kilobytes.
TEXT = " ".join(f"word{i}" for i in range(600))


@pytest.fixture
def full_redis(tmp_path: Path) -> Iterator[tuple[str, redis.Redis]]:
    proc, url = start_redis_server(
        tmp_path,
        args=("--save", "", "--appendonly", "no",
              "--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction"),
    )  # fmt: skip
    redis.Redis.from_url(url).config_set("requirepass", PASSWORD)  # once it answered PING
    client = redis.Redis.from_url(url, password=PASSWORD)
    try:
        yield url, client
    finally:
        client.close()
        stop_redis_server(proc)


@pytest.fixture
def double() -> Iterator[EngineDouble]:
    with running_doubles(1) as doubles:
        doubles[0].default = lambda _prompt, _sampling: ScriptedCompletion(list(OK_REPLY))
        yield doubles[0]


@pytest.fixture
def server(
    tmp_path: Path, double: EngineDouble, full_redis: tuple[str, redis.Redis]
) -> Iterator[LiveServer]:
    url, _ = full_redis
    with pytest.raises(redis.AuthenticationError):  # the URL alone does not get in
        redis.Redis.from_url(url).ping()
    live = start_server(
        tmp_path,
        double,
        "--admin-key",
        ADMIN_KEY,
        env={
            "TOKENKEEP_REDIS_URL": url,
            "TOKENKEEP_REDIS_PASSWORD": PASSWORD,
            "TOKENKEEP_STARTUP_CHECK": "false",
        },
    )
    try:
        yield live
    finally:
        stop_server(live)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} on /metrics")


def _turn(server: LiveServer, session_id: str) -> httpx.Response:
    with server.client(server.sessions[session_id]) as client:
        return client.post(
            f"/sessions/{session_id}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": TEXT}]},
        )


def test_full_redis_refuses_turns_cleanly_and_loses_nothing_acknowledged(
    server: LiveServer, full_redis: tuple[str, redis.Redis]
) -> None:
    _, direct = full_redis
    for i in range(SESSIONS):
        server.create(f"s{i}")
    # Most of the memory goes to ballast keys, so a few dozen turns fill the rest.
    ballast = 0
    while int(direct.info("memory")["used_memory"]) < MAXMEMORY - 384 * 1024:
        direct.set(f"ballast{ballast}", b"x" * 64 * 1024)
        ballast += 1

    acknowledged: list[str] = []
    refused: httpx.Response | None = None
    for i in range(SESSIONS):
        answer = _turn(server, f"s{i}")
        if answer.status_code == 200:
            acknowledged.append(f"s{i}")
            continue
        refused = answer
        break
    assert refused is not None, f"{len(acknowledged)} turns fit in Redis; it never filled"
    refused_session = f"s{len(acknowledged)}"
    assert acknowledged, "not one turn fit before Redis was full"
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "5"
    assert "session store full" in refused.json()["error"]["message"]
    with server.client(server.sessions[refused_session]) as client:  # the Anthropic shape
        claude = client.post(
            f"/sessions/{refused_session}/v1/messages",
            json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": TEXT}]},
        )
    assert claude.status_code == 503 and claude.json()["type"] == "error"
    assert "session store full" in claude.json()["error"]["message"]

    # Nothing acknowledged is lost; the refused turns stored nothing.
    for session_id in acknowledged:
        assert server.turns(session_id) == 1
    assert server.turns(refused_session) == 0
    assert httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200
    with server.admin() as admin:
        metrics = admin.get("/metrics").text
        policy = admin.get("/policy").json()  # what the operator polls for its status
        trajectory = admin.get(f"/sessions/{acknowledged[0]}/trajectory")
    assert trajectory.status_code == 200, trajectory.text  # reading still works while full
    assert _metric(metrics, "tokenkeep_store_max_memory_bytes") == MAXMEMORY
    assert _metric(metrics, "tokenkeep_store_used_memory_bytes") > MAXMEMORY * 0.9
    assert _metric(metrics, "tokenkeep_store_full_refusals_total") >= 2
    [store_full] = [c for c in server_conditions(policy, 1) if c["type"] == "StoreFull"]
    assert (store_full["status"], store_full["reason"]) == ("True", "StoreFull")
    assert f"of its maxmemory {MAXMEMORY} bytes" in store_full["message"]

    # Memory freed (sessions exported and deleted, or a bigger maxmemory).
    direct.delete(*(f"ballast{i}" for i in range(ballast)))
    deadline = time.monotonic() + 10
    while (again := _turn(server, refused_session)).status_code != 200:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.2)
    assert server.turns(refused_session) == 1
    with server.admin() as admin:
        policy = admin.get("/policy").json()
    [store_full] = [c for c in server_conditions(policy, 1) if c["type"] == "StoreFull"]
    assert (store_full["status"], store_full["reason"]) == ("False", "StoreHasRoom")
    for session_id in acknowledged:
        assert server.turns(session_id) == 1
