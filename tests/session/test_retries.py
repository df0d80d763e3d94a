"""Retries never split a rollout: concurrent identical requests and Idempotency-Key resends,
through the official SDKs over HTTP, on both stores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx

from tests.engine_double import HttpFault, ScriptedCompletion
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack

USER = [{"role": "user", "content": "Name a colour."}]


def _summary(stack: Stack, session_id: str) -> dict[str, Any]:
    with stack.http() as client:
        return client.get(f"/sessions/{session_id}").json()


def _chat(stack: Stack, session_id: str, headers: dict[str, str] | None = None) -> httpx.Response:
    with stack.http() as client:
        return client.post(
            f"/sessions/{session_id}/v1/chat/completions",
            json={"model": "m", "messages": USER},
            headers=headers or {},
        )


def test_concurrent_identical_requests_are_one_root_and_retries(stack: Stack) -> None:
    """Six identical first requests at once (each still generating when the others arrive)
    store one `first` root and five `retry` siblings with the same prompt."""
    replies = [tokens(stack.model, f"Colour {i}", END) for i in range(6)]
    stack.double.script(*(ScriptedCompletion(ids) for ids in replies))
    stack.double.latency_s = 0.4
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: _chat(stack, "race"), range(6)))
    finally:
        stack.double.latency_s = 0.0
    assert [a.status_code for a in answers] == [200] * 6
    kinds = sorted(a.json()["tokenkeep"]["kind"] for a in answers)
    assert kinds == ["first"] + ["retry"] * 5
    summary = _summary(stack, "race")
    assert summary["turns_by_kind"] == {"first": 1, "retry": 5}
    assert summary["segments"] == 6 and summary["breaks"] == {}
    prompts = stack.prompts()
    assert all(p == prompts[0] for p in prompts)
    # Every sampled reply is on record, none invented.
    trajectory = stack.trajectory("race")
    sampled = sorted(
        br["segments"][0]["token_ids"][br["segments"][0]["turns"][0]["completion_span"][0] :]
        for br in trajectory["branches"]
    )
    assert sampled == sorted(replies)


def test_idempotency_key_resend_returns_the_stored_reply(stack: Stack) -> None:
    ids = tokens(stack.model, "Blue", END)
    stack.double.script(ScriptedCompletion(ids))
    key = {"Idempotency-Key": "call-1"}
    first = _chat(stack, "idem", key)
    assert first.status_code == 200
    engine_calls = len(stack.double.requests)
    again = _chat(stack, "idem", key)
    assert again.status_code == 200
    a, b = first.json(), again.json()
    assert b["id"] == a["id"]
    assert (
        b["choices"][0]["message"]
        == a["choices"][0]["message"]
        == {
            "role": "assistant",
            "content": "Blue",
        }
    )
    assert b["tokenkeep"]["turn_ids"] == a["tokenkeep"]["turn_ids"] == [1]
    assert len(stack.double.requests) == engine_calls  # no engine call
    assert _summary(stack, "idem")["turns"] == 1  # no new turn
    # A streamed resend of another key is answered the same way, as a stream.
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Red", END)))
    client = stack.openai("idem")
    made = client.chat.completions.create(
        model="m", messages=USER, extra_headers={"Idempotency-Key": "call-2"}
    )
    calls = len(stack.double.requests)
    with stack.http() as http:
        body = {"model": "m", "messages": USER}
        resent = http.post(
            "/sessions/idem/v1/chat/completions", json=body, headers={"Idempotency-Key": "call-2"}
        ).json()
    assert resent["id"] == made.id and resent["choices"][0]["message"]["content"] == "Red"
    assert len(stack.double.requests) == calls
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Green", END)))
    streamed = client.chat.completions.create(
        model="m",
        messages=USER,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"Idempotency-Key": "call-3"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    calls = len(stack.double.requests)
    restreamed = client.chat.completions.create(
        model="m",
        messages=USER,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"Idempotency-Key": "call-3"},
    )
    chunks = list(restreamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].model_extra["tokenkeep"]["turn_ids"] == [3]
    assert len(stack.double.requests) == calls
    assert _summary(stack, "idem")["turns"] == 3


def test_idempotency_resend_while_generating_waits_for_that_reply(stack: Stack) -> None:
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Teal", END)))
    stack.double.latency_s = 0.5
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(lambda _: _chat(stack, "wait", {"Idempotency-Key": "k"}), range(4))
            )
    finally:
        stack.double.latency_s = 0.0
    bodies = [a.json() for a in answers]
    assert {b["id"] for b in bodies} == {bodies[0]["id"]}
    assert all(b["choices"][0]["message"]["content"] == "Teal" for b in bodies)
    assert len(stack.double.requests) == 1
    assert _summary(stack, "wait")["turns"] == 1


def test_idempotency_key_bad_input_changes_nothing(stack: Stack) -> None:
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Blue", END)))
    assert _chat(stack, "bad", {"Idempotency-Key": "same"}).status_code == 200
    with stack.http() as client:
        other = client.post(
            "/sessions/bad/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "Another"}]},
            headers={"Idempotency-Key": "same"},
        )
        assert other.status_code == 422
        assert other.json()["error"]["type"] == "idempotency_key_reused"
        long = client.post(
            "/sessions/bad/v1/chat/completions",
            json={"model": "m", "messages": USER},
            headers={"Idempotency-Key": "k" * 256},
        )
        assert long.status_code == 400 and long.json()["error"]["param"] == "Idempotency-Key"
        anthropic_long = client.post(
            "/sessions/bad/v1/messages",
            json={"model": "m", "max_tokens": 5, "messages": USER},
            headers={"Idempotency-Key": "k" * 256},
        )
        assert anthropic_long.status_code == 400
        assert anthropic_long.json()["type"] == "error"
    assert _summary(stack, "bad")["turns"] == 1
    assert len(stack.double.requests) == 1


def test_idempotency_key_after_a_failure_runs_again(stack: Stack) -> None:
    """A request that failed stored nothing and frees its key: the resend generates."""
    stack.double.fail_next(HttpFault(400, "bad sampling", "BadRequestError"))
    assert _chat(stack, "fail", {"Idempotency-Key": "f"}).status_code == 400
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Gold", END)))
    again = _chat(stack, "fail", {"Idempotency-Key": "f"})
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == "Gold"
    assert _summary(stack, "fail")["turns"] == 1


def test_idempotency_key_on_messages_and_responses(stack: Stack) -> None:
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Blue", END)))
    claude = anthropic.Anthropic(
        base_url=f"{stack.url}/sessions/multi", api_key="unused", max_retries=0
    )
    sent = claude.messages.create(
        model="m", max_tokens=20, messages=USER, extra_headers={"Idempotency-Key": "m1"}
    )
    resent = claude.messages.create(
        model="m", max_tokens=20, messages=USER, extra_headers={"Idempotency-Key": "m1"}
    )
    assert resent.id == sent.id and resent.content[0].text == "Blue"  # type: ignore[union-attr]
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Red", END)))
    client = stack.openai("multi")
    made = client.responses.create(
        model="m", input="Name a colour.", extra_headers={"Idempotency-Key": "r1"}
    )
    again = client.responses.create(
        model="m", input="Name a colour.", extra_headers={"Idempotency-Key": "r1"}
    )
    assert again.id == made.id and again.output_text == made.output_text == "Red"
    assert len(stack.double.requests) == 2
    assert _summary(stack, "multi")["turns_by_kind"] == {"first": 1, "retry": 1}


def test_branches_last_is_the_path_to_the_newest_turn(stack: Stack) -> None:
    """A retry leaves two leaves; `branches=last` exports only the newer one, as JSON,
    JSONL and in the batch export; anything else is a 400 that changes nothing."""
    first = tokens(stack.model, "Blue", END)
    second = tokens(stack.model, "Red", END)
    stack.double.script(ScriptedCompletion(first), ScriptedCompletion(second))
    assert _chat(stack, "last").status_code == 200
    assert _chat(stack, "last").json()["tokenkeep"]["kind"] == "retry"
    with stack.http() as client:
        every = client.get("/sessions/last/trajectory").json()
        assert [b["leaf_turn_id"] for b in every["branches"]] == [1, 2]
        last = client.get("/sessions/last/trajectory", params={"branches": "last"}).json()
        assert [b["leaf_turn_id"] for b in last["branches"]] == [2]
        segment = last["branches"][0]["segments"][0]
        assert segment["token_ids"][segment["turns"][0]["completion_span"][0] :] == second
        lines = client.get(
            "/sessions/last/trajectory", params={"branches": "last", "format": "jsonl"}
        ).text.splitlines()
        assert len(lines) == 1 and '"leaf_turn_id":2' in lines[0].replace(" ", "")
        bad = client.get("/sessions/last/trajectory", params={"branches": "first"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.branches"
        assert client.post("/sessions/last/finish", json={}).status_code == 200
        rows = client.post(
            "/sessions/export", json={"session_ids": ["last"], "branches": "last"}
        ).text.splitlines()
        assert len(rows) == 1 and '"leaf_turn_id":2' in rows[0]
        bad_batch = client.post(
            "/sessions/export", json={"session_ids": ["last"], "branches": "none"}
        )
        assert bad_batch.status_code == 400
    assert _summary(stack, "last")["turns"] == 2


def test_openapi_schema_documents_keys_branches_and_abort(memory_stack: Stack) -> None:
    with memory_stack.http() as client:
        schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path in (
        "/sessions/{session_id}/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/v1/completions",
    ):
        names = [p["name"] for p in paths[path]["post"].get("parameters", [])]
        assert "Idempotency-Key" in names, path
    trajectory = paths["/sessions/{session_id}/trajectory"]["get"]["parameters"]
    branches = next(p for p in trajectory if p["name"] == "branches")
    assert branches["schema"]["enum"] == ["all", "last"]
    assert "post" in paths["/sessions/{session_id}/abort"]
