"""`--max-policy-lag`: a rollout that drifted too far off-policy is refused before the engine
is called, in each API's error shape, and the session says so."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from session_server.splice import ChatModel
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack, make_stack
from tokenkeep import Client


@pytest.fixture(params=["memory", "redis"])
def lag_stack(
    request: pytest.FixtureRequest,
    qwen3_model: ChatModel,
    engine_double: EngineDouble,
    redis_server: str,
) -> Iterator[Stack]:
    yield from make_stack(qwen3_model, engine_double, request.param, redis_server, max_policy_lag=1)


def _turn(client: httpx.Client, messages: list[dict[str, Any]]) -> httpx.Response:
    return client.post(
        "/sessions/lag/v1/chat/completions", json={"model": "m", "messages": messages}
    )


def test_turns_beyond_the_policy_lag_are_refused_without_an_engine_call(
    lag_stack: Stack,
) -> None:
    stack = lag_stack
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count."}]
    with stack.http() as client:
        for version in ("1", "2", "3"):
            stack.double.weight_version = version
            stack.double.script(ScriptedCompletion(tokens(stack.model, f"v{version}", END)))
            answer = _turn(client, messages)
            assert answer.status_code == 200, answer.text
            messages += [
                {"role": "assistant", "content": f"v{version}"},
                {"role": "user", "content": "More."},
            ]
        # Sampled at 1, the engine now serves 3 > 1 + 1.
        calls = len(stack.double.requests)
        refused = _turn(client, messages)
        assert refused.status_code == 409
        assert refused.json()["error"]["type"] == "policy_lag_exceeded"
        claude = client.post(
            "/sessions/lag/v1/messages",
            json={"model": "m", "max_tokens": 5, "messages": messages},
        )
        assert claude.status_code == 409 and claude.json()["type"] == "error"
        # A retry of the first turn belongs to the same rollout: refused as well.
        assert _turn(client, messages[:1]).status_code == 409
        assert len(stack.double.requests) == calls
        summary = client.get("/sessions/lag").json()
        assert summary["turns"] == 3
        assert summary["first_weight_version"] == "1"
        assert summary["policy_lag_exceeded"] is True
        metrics = client.get("/metrics").text
        assert 'tokenkeep_rejected_requests_total{reason="policy_lag"} 3.0' in metrics
        # A new rollout (another session) starts at the current version and is served.
        stack.double.script(ScriptedCompletion(tokens(stack.model, "fresh", END)))
        fresh = client.post(
            "/sessions/lag2/v1/chat/completions",
            json={"model": "m", "messages": messages[:1]},
        )
        assert fresh.status_code == 200
        assert client.get("/sessions/lag2").json()["policy_lag_exceeded"] is False
    # Finished, both rollouts carry the lag in the listing and in the export rows, as the
    # Python client reads them.
    with Client(stack.url) as tk:
        tk.finish("lag", reward=0.0)
        tk.finish("lag2", reward=1.0)
        listed = {s.id: s for s in tk.list_finished()}
        assert (listed["lag"].first_weight_version, listed["lag"].policy_lag_exceeded) == (
            "1",
            True,
        )
        assert (listed["lag2"].first_weight_version, listed["lag2"].policy_lag_exceeded) == (
            "3",
            False,
        )
        rows = {row.session_id: row for row in tk.export(session_ids=["lag", "lag2"])}
        assert (rows["lag"].first_weight_version, rows["lag"].policy_lag_exceeded) == ("1", True)
        assert (rows["lag2"].first_weight_version, rows["lag2"].policy_lag_exceeded) == (
            "3",
            False,
        )


def test_the_lag_counts_from_the_published_version() -> None:
    """After `POST /policy`, a rollout's lag is measured against the published version even
    while a replica still reports an older one (it is fenced until it catches up)."""
    from session_server.engines import EngineClient
    from session_server.metrics import Metrics
    from session_server.service_config import ServiceConfig
    from session_server.turns.policy import PolicyLag

    engine = EngineClient(["http://127.0.0.1:9"], model="m")
    engine.replicas[0].weight_version = "2"
    lag = PolicyLag(engine, ServiceConfig("m", 4096, max_policy_lag=1), Metrics())
    assert not lag.lag_exceeded("1")
    engine.published_version = "5"
    assert lag.engine_version() == 5
    assert lag.lag_exceeded("1") and not lag.lag_exceeded("4")
