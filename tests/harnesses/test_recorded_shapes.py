"""The request shapes real harnesses sent (`tests/fixtures/harnesses/`), replayed without
the harness: every request parses, and the recorded multi-turn run is one contiguous
trajectory again."""

from __future__ import annotations

from typing import Any

import pytest

from session_server.api import messages, responses
from tests.api.stack import serving
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import CONTEXT
from tests.harnesses.recording import load_fixtures
from tests.harnesses.replay import harness_posts, replay

FIXTURES = load_fixtures()


def test_fixtures_exist() -> None:
    harnesses = {fixture["harness"].split("==")[0].split("@2")[0] for _, fixture in FIXTURES}
    assert {"openai-agents", "@anthropic-ai/claude-code"} <= harnesses


@pytest.mark.parametrize(("name", "fixture"), FIXTURES, ids=[name for name, _ in FIXTURES])
def test_requests_parse(name: str, fixture: dict[str, Any]) -> None:
    for post in harness_posts(fixture):
        if post["path"].endswith("/messages"):
            wire = messages.MessagesRequest.model_validate(post["body"])
            conversation = messages.conversation_from_request(wire)
        else:
            conversation = responses.conversation_from_request(
                responses.ResponsesRequest.model_validate(post["body"])
            )
        assert conversation.messages
        assert conversation.tools


def test_claude_code_shape() -> None:
    """What Claude Code sends that a Messages server must take: a billing line in the system
    blocks, its environment as a `system` turn inside `messages`, thinking blocks sent back."""
    [fixture] = [f for name, f in FIXTURES if name.startswith("claude-code")]
    posts = harness_posts(fixture)
    assert all(post["query"] == "beta=true" and post["body"]["stream"] for post in posts)
    last = messages.conversation_from_request(
        messages.MessagesRequest.model_validate(posts[-1]["body"])
    )
    roles = [m.role for m in last.messages]
    assert roles == ["system", "user", "system", "assistant", "tool", "assistant", "tool"]
    assert last.messages[0].content.startswith("x-anthropic-billing-header:")
    assert last.messages[3].reasoning and last.messages[3].tool_calls


@pytest.fixture(scope="module")
def double() -> Any:
    engine = EngineDouble(max_model_len=CONTEXT).start()
    yield engine
    engine.stop()


@pytest.mark.parametrize(("name", "fixture"), FIXTURES, ids=[name for name, _ in FIXTURES])
async def test_replay_is_contiguous(
    double: EngineDouble, name: str, fixture: dict[str, Any]
) -> None:
    async with serving(double, context_length=CONTEXT) as stack:
        answers = await replay(stack, fixture, f"replay-{name}")
        assert [a.status_code for a in answers] == [200] * len(answers)
        stack.assert_contiguous()
        trajectory = await stack.get(f"/sessions/replay-{name}/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert len(segment["turns"]) == len(answers)


def test_codex_shape() -> None:
    """What Codex sends that a Responses server must take: a `namespace` tool (its functions
    offered as `<namespace>__<name>`), a hosted `web_search` (not offered), developer
    messages, and on later turns the reasoning and function_call items it was given."""
    [fixture] = [f for name, f in FIXTURES if name.startswith("codex")]
    posts = harness_posts(fixture)
    first = responses.ResponsesRequest.model_validate(posts[0]["body"])
    assert first.store is False and "reasoning.encrypted_content" in first.include
    offered = [t.name for t in responses.conversation_from_request(first).tools]
    assert "exec_command" in offered and "multi_agent_v1__spawn_agent" in offered
    assert not any("web_search" in name for name in offered)
    last = responses.conversation_from_request(
        responses.ResponsesRequest.model_validate(posts[-1]["body"])
    )
    roles = [m.role for m in last.messages]
    assert roles[:2] == ["system", "system"] and roles[-2:] == ["assistant", "tool"]
    assert last.messages[-2].tool_calls[0].name == "exec_command"
