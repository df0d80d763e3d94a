"""`tool_choice` against the real vLLM CPU engine: the tiny random-weights Qwen3 samples
noise, so a tool call in its replies is there because the constraint tokenkeep sent made it
so, in Qwen3's own `<tool_call>` syntax, parsed back from the sampled tokens."""

from __future__ import annotations

import uuid

import pytest

from tests.integration.conftest import RealStack, real_stack

pytestmark = pytest.mark.vllm
__all__ = ["real_stack"]

PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "description": "Check the line.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "description": "Write a note.",
        "parameters": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "ping"}}], ids=str
)
def test_random_weights_still_call_the_tool(real_stack: RealStack, choice: object) -> None:
    session = real_stack.http().post("/sessions", json={"id": f"tc-{uuid.uuid4().hex}"}).json()
    completion = real_stack.openai(session).chat.completions.create(
        model=real_stack.engine.served_model_name,
        messages=[{"role": "user", "content": "Check the line."}],
        tools=[PING, NOTE] if choice == "required" else [NOTE, PING],
        tool_choice=choice,  # type: ignore[arg-type]
        max_tokens=96,
        temperature=0.0,
        # constrain from the first token, no thinking; the reply carries its sampled tokens
        extra_body={"reasoning_ended": True, "return_token_ids": True},
    )
    calls = completion.choices[0].message.tool_calls or []
    assert calls, completion.choices[0].message
    names = {c.function.name for c in calls}
    assert names <= {"ping", "note"} if choice == "required" else names == {"ping"}
    sampled = real_stack.model.decode(completion.choices[0].token_ids)  # type: ignore[attr-defined]
    assert sampled.startswith('<tool_call>\n{"name": "')
