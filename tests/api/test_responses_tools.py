"""Every Responses tool type Codex can send, through the official SDK and the real session
core: what the model is offered, the item each call comes back as, and that resending those
items (as a `store: false` client does) extends the stored tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from session_server.api import responses
from session_server.api.response_tools import open_reasoning, seal_reasoning
from tests.api.stack import Stack, reply, serving, tool_call
from tests.engine_double import EngineDouble

NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn a sub-agent",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"message": {"type": "string"}},
                "required": ["message"],
            },
        }
    ],
}
CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}
TOOLS = [NAMESPACE, CUSTOM, {"type": "local_shell"}, {"type": "web_search"}]


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble().start()
    yield engine
    engine.stop()


async def ask(stack: Stack, session: str, items: list[Any], stream: bool, **extra: Any) -> Any:
    request = {"model": "m", "input": items, "tools": TOOLS, "store": False, **extra}
    client = stack.openai(session)
    if not stream:
        return await client.responses.create(**request)
    async with client.responses.stream(**request) as events:
        return await events.get_final_response()


def offered_tools(stack: Stack) -> list[str]:
    """The function names the chat template rendered into the engine's prompt."""
    prompt = stack.service.model.decode(stack.engine_requests()[-1].prompt_ids)
    return [json.loads(line)["function"]["name"] for line in
            prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_each_tool_type_round_trips_contiguously(double: EngineDouble, stream: bool) -> None:
    async with serving(double) as stack:
        session = f"tools-{stream}"
        stack.script(
            tool_call("multi_agent_v1__spawn_agent", '{"message": "review"}', think="Delegate."),
            tool_call("apply_patch", '{"input": "*** Begin Patch\\n*** End Patch"}'),
            tool_call("local_shell", '{"command": ["ls", "-l"], "workdir": "/tmp"}'),
            reply("All done."),
        )
        items: list[Any] = [{"role": "user", "content": "Work."}]
        outputs = []
        for _ in range(3):
            response = await ask(stack, session, items, stream)
            outputs.append(response.output[-1])
            items += [item.model_dump(exclude_none=True) for item in response.output]
            call = response.output[-1]
            kind = "custom_tool_call_output" if call.type == "custom_tool_call" else None
            items.append({"type": kind or "function_call_output", "call_id": call.call_id,
                          "output": "ok"})  # fmt: skip
        final = await ask(stack, session, items, stream)

        assert offered_tools(stack) == ["multi_agent_v1__spawn_agent", "apply_patch", "local_shell"]
        spawn, patch, shell = outputs
        assert (spawn.type, spawn.name, spawn.namespace) == (
            "function_call", "spawn_agent", "multi_agent_v1"
        )  # fmt: skip
        assert json.loads(spawn.arguments) == {"message": "review"}
        assert (patch.type, patch.name, patch.input) == (
            "custom_tool_call", "apply_patch", "*** Begin Patch\n*** End Patch"
        )  # fmt: skip
        assert shell.type == "local_shell_call"
        assert shell.action.command == ["ls", "-l"] and shell.action.working_directory == "/tmp"
        assert final.output_text == "All done."
        stack.assert_contiguous()
        trajectory = await stack.get(f"/sessions/{session}/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend", "extend", "extend"]


async def test_reasoning_items_are_sealed_when_asked(double: EngineDouble) -> None:
    async with serving(double) as stack:
        stack.script(
            tool_call("local_shell", '{"command": ["true"]}', think="Plan it."),
            tool_call("local_shell", '{"command": ["true"]}', think="Plan it."),
            reply("Done."),
        )
        go = [{"role": "user", "content": "Go."}]
        plain = await ask(stack, "plain", go, False)
        assert plain.output[0].type == "reasoning" and plain.output[0].encrypted_content is None
        first = await ask(stack, "sealed", go, True, include=["reasoning.encrypted_content"])
        sealed = first.output[0].encrypted_content
        assert sealed.startswith("tk1.")
        call = first.output[1].model_dump(exclude_none=True)
        tampered = sealed[:-1] + ("A" if sealed[-1] != "A" else "B")
        second = await ask(stack, "sealed", [
            *go, {"type": "reasoning", "summary": [], "encrypted_content": tampered}, call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"},
        ], False)  # fmt: skip
        assert second.output_text == "Done."
        trajectory = await stack.get("/sessions/sealed/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]  # lineage from the messages, never from the value
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend"]


def test_sealed_reasoning_is_read_back_only_when_intact_and_ours() -> None:
    key = b"k" * 32
    sealed = seal_reasoning(key, "s1", "r1", "Plan it.")

    def restored(value: str, session: str = "s1") -> str | None:
        wire = responses.ResponsesRequest.model_validate({"model": "m", "input": [
            {"role": "user", "content": "Go."},
            {"type": "reasoning", "summary": [], "encrypted_content": value},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ]})  # fmt: skip
        conversation = responses.conversation_from_request(
            wire, reasoning=lambda v: open_reasoning(key, session, v)
        )
        return conversation.messages[1].reasoning

    assert restored(sealed) == "Plan it."
    body = sealed.split(".")[1]
    forged = seal_reasoning(b"x" * 32, "s1", "r1", "Other.")
    assert restored(sealed.replace(body, body[:-2] + "xx")) == ""  # tampered: the item's text
    assert restored(forged) == ""  # another server's key
    assert restored(sealed, session="s2") == ""  # another session's turn
