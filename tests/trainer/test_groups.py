"""Rollout groups and finish statuses through a live server (real HTTP, both stores, the
engine double): a group leaves the batch export whole, a failed member is held or dropped
as the trainer asks, and bad input changes nothing."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.session.conftest import Stack
from tests.trainer.test_weight_versions import said
from tokenkeep import Client, TokenkeepError


def member(stack: Stack, client: Client, group: str, size: int, text: str) -> str:
    session = client.create_session(group=group, group_size=size, metadata={"group": group})
    stack.double.script(said(stack, text))
    stack.openai(session.id).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say it."}]
    )
    return session.id


def test_a_group_is_exported_only_when_every_member_finished(stack: Stack) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    with Client(stack.url) as client, httpx.Client(base_url=stack.url) as http:
        ids = [member(stack, client, group, 3, text) for text in ("One.", "Two.", "Three.")]
        client.finish(ids[0], reward=1.0)
        client.finish(ids[1], reward=0.0)

        state = http.get("/sessions", params={"group": group}).json()
        assert (state["size"], state["finished"], state["running"], state["complete"]) == (
            3,
            2,
            1,
            False,
        )
        assert [m["id"] for m in state["members"]] == ids
        assert [m["finish"] and m["finish"]["reward"] for m in state["members"]] == [1.0, 0.0, None]

        # Selected by metadata: the running group is held back, not half-exported.
        with pytest.raises(TokenkeepError) as nothing:
            list(client.export(selector=f"group={group}"))
        assert nothing.value.status == 404
        # Named, or by group: refused while it runs.
        for selection in ({"group": group}, {"session_ids": ids[:2]}):
            with pytest.raises(TokenkeepError) as running:
                list(client.export(**selection))  # type: ignore[arg-type]
            assert running.value.status == 409 and "still running" in str(running.value)

        client.finish(ids[2], reward=0.5)
        assert http.get("/sessions", params={"group": group}).json()["complete"] is True
        # One member named: the whole group comes, each row tagged with it.
        rows = list(client.export(session_ids=[ids[0]]))
        assert [r.session_id for r in rows] == ids
        assert [(r.reward, r.status, r.group) for r in rows] == [
            (1.0, "ok", group),
            (0.0, "ok", group),
            (0.5, "ok", group),
        ]
        batch = client.export_batch(group=group)
        assert batch.groups == [group] * 3 and batch.rewards.tolist() == [1.0, 0.0, 0.5]
        assert batch.token_ids[0, : len(rows[0].token_ids)].tolist() == rows[0].token_ids


def test_a_failed_member_holds_its_group_or_is_dropped(stack: Stack) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    with Client(stack.url) as client, httpx.Client(base_url=stack.url) as http:
        ids = [member(stack, client, group, 2, text) for text in ("Fine.", "Broken.")]
        client.finish(ids[0], reward=1.0)
        failed = client.finish(ids[1], status="env_error")
        assert failed.status == "env_error" and failed.reward is None

        state = http.get("/sessions", params={"group": group}).json()
        assert state["complete"] and state["failed"] == [ids[1]]
        assert state["statuses"] == {"ok": 1, "env_error": 1}

        with pytest.raises(TokenkeepError) as held:
            list(client.export(group=group))
        assert held.value.status == 409 and "held" in str(held.value)
        with pytest.raises(TokenkeepError):
            list(client.export(selector=f"group={group}"))  # held: nothing to export
        rows = list(client.export(group=group, failed_members="drop"))
        assert [(r.session_id, r.status) for r in rows] == [(ids[0], "ok")]
        # Nothing was lost by holding: the failed session is still there, listed by status.
        listed = http.get("/sessions", params={"status": "env_error,aborted"}).json()
        assert ids[1] in [s["id"] for s in listed["sessions"]]
        assert ids[0] not in [s["id"] for s in listed["sessions"]]


def test_bad_finishes_and_groups_are_refused_and_change_nothing(stack: Stack) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    with Client(stack.url) as client, httpx.Client(base_url=stack.url) as http:
        sid = member(stack, client, group, 1, "Done.")
        before = http.get(f"/sessions/{sid}/trajectory").json()
        for body in (
            b'{"reward": "high"}',
            b'{"reward": "1.0"}',
            b'{"reward": true}',
            b'{"reward": [1]}',
            b'{"reward": NaN}',
            b'{"reward": Infinity}',
            b'{"reward": 1e400}',
            b'{"status": "crashed"}',
        ):
            answer = http.post(
                f"/sessions/{sid}/finish",
                content=body,
                headers={"content-type": "application/json"},
            )
            assert answer.status_code == 400, (body, answer.text)
            assert "error" in answer.json()
        assert http.get(f"/sessions/{sid}").json()["finish"] is None
        client.finish(sid, reward=0.25, status="model_error")
        again = http.post(f"/sessions/{sid}/finish", json={"reward": 1.0})
        assert again.status_code == 409 and "already finished" in again.json()["error"]["message"]
        info = http.get(f"/sessions/{sid}").json()
        assert (info["finish"]["reward"], info["finish"]["status"]) == (0.25, "model_error")
        assert (info["group"], info["group_size"]) == (group, 1)
        assert http.get(f"/sessions/{sid}/trajectory").json() == before

        for body in ({"group": group}, {"group_size": 2}, {"group": "a b", "group_size": 2}):
            refused = http.post("/sessions", json=body)
            assert refused.status_code == 400 and "error" in refused.json(), body
        for params in ({"status": "fine"}, {"status": ""}):
            assert http.get("/sessions", params=params).status_code == 400
        assert http.get("/sessions", params={"group": "no-such-group"}).status_code == 404
        missing = http.post("/sessions/export", json={"group": "no-such-group"})
        assert missing.status_code == 404
        bad = http.post("/sessions/export", json={"status": ["fine"]})
        assert bad.status_code == 400 and "error" in bad.json()
