"""Claude Code puts a billing line in its system prompt (`x-anthropic-billing-header:
cc_version=...; cc_entrypoint=...;`) whose value changes between conversations and, in some
releases, between requests. Replayed from the recorded Claude Code run with the line changed
on every request:
- without normalization rules the history no longer matches, and each request starts a new
  segment with the reason recorded (nothing sampled is silently dropped);
- with a session rule that ignores the line, the run is one contiguous trajectory and the
  model keeps seeing the line it saw first."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from tests.api.stack import qwen3, serving
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import CONTEXT
from tests.harnesses.recording import load_fixtures
from tests.harnesses.replay import harness_posts, replay

BILLING_RULE = {"pattern": r"^x-anthropic-billing-header:.*$"}


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble(max_model_len=CONTEXT).start()
    yield engine
    engine.stop()


def claude_code_run() -> dict[str, Any]:
    [fixture] = [f for name, f in load_fixtures() if name.startswith("claude-code")]
    return fixture


def billing(i: int) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.330.{i:03x}; cc_entrypoint=cli; cch={i}f9;"


def with_changing_billing_line(fixture: dict[str, Any]) -> list[dict[str, Any]]:
    bodies = []
    for i, post in enumerate(harness_posts(fixture)):
        body = copy.deepcopy(post["body"])
        assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
        body["system"][0]["text"] = billing(i)
        bodies.append(body)
    return bodies


async def create_session(stack: Any, session_id: str, rules: list[dict[str, str]]) -> None:
    async with httpx2.AsyncClient(transport=stack.transport(), base_url="http://t") as http:
        created = await http.post("/sessions", json={"id": session_id, "normalization": rules})
        assert created.status_code == 201, created.text


async def test_without_rules_each_request_starts_a_segment(double: EngineDouble) -> None:
    fixture = claude_code_run()
    async with serving(double, context_length=CONTEXT) as stack:
        await create_session(stack, "volatile-off", [])
        answers = await replay(stack, fixture, "volatile-off", with_changing_billing_line(fixture))
        assert all(a.status_code == 200 for a in answers)
        summary = await stack.get("/sessions/volatile-off")
        assert summary["segments"] == len(answers)
        assert summary["breaks"] == {"history_mismatch": len(answers) - 1}


async def test_rule_keeps_one_trajectory_and_the_first_line(double: EngineDouble) -> None:
    fixture = claude_code_run()
    async with serving(double, context_length=CONTEXT) as stack:
        await create_session(stack, "volatile-on", [BILLING_RULE])
        answers = await replay(stack, fixture, "volatile-on", with_changing_billing_line(fixture))
        assert all(a.status_code == 200 for a in answers)
        stack.assert_contiguous()
        trajectory = await stack.get("/sessions/volatile-on/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend", "extend"]
        last_prompt = qwen3().decode(stack.engine_requests()[-1].prompt_ids)
        assert billing(0) in last_prompt
        assert billing(1) not in last_prompt and billing(2) not in last_prompt
        # what was ignored is on record, turn by turn
        assert [t.get("volatile") for t in segment["turns"]] == [[billing(i)] for i in range(3)]
