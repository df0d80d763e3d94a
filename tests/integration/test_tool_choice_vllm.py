"""`tool_choice` against the real vLLM CPU engine: the tiny random-weights Qwen3 samples
noise, so a tool call in its replies is there because the constraint tokenkeep sent made it
so, in Qwen3's own `<tool_call>` syntax, parsed back from the sampled tokens. Gemma 4 (no
Gemma 4 weights run here): its constraint under the engine's own xgrammar, with its real
vocabulary."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from session_server.check import load_model
from session_server.conversation import Tool
from session_server.devtools import localengine
from session_server.tool_choice import tool_choice_constraint
from tests.integration.conftest import RealStack, real_stack
from tests.real_tokenizers import gemma4_dir

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


# Run by the engine's own Python: vLLM's xgrammar compiles the structural tag for the served
# tokenizer and walks each case's tokens as vLLM's matcher would (with the request's stop
# tokens, as vLLM passes them).
_XGRAMMAR_WALK = """
import json, sys
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast
job = json.load(sys.stdin)
tokenizer = PreTrainedTokenizerFast.from_pretrained(job["tokenizer"])
info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer.get_vocab()))
compiler = xgr.GrammarCompiler(info)
verdicts = []
for case in job["cases"]:
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(case["tag"]),
                                 override_stop_tokens=job["stops"])
    verdicts.append(all(matcher.accept_token(t) for t in case["ids"]) and matcher.is_terminated())
print(json.dumps(verdicts))
"""

PLAN_TRIP = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "description": "Plan a trip.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "Budget": {"type": "number"},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
                "flags": {"type": "array", "items": {"type": "boolean"}},
                "stay": {
                    "type": "object",
                    "properties": {"hotel": {"type": "string"}, "nights": {"type": "integer"}},
                    "required": ["hotel"],
                },
                "notes": {},
            },
            "required": ["city", "units"],
        },
    },
}


def test_gemma4_constraint_takes_the_templates_own_calls_in_vllms_xgrammar() -> None:
    """Gemma 4's `tool_choice` constraint (a structural tag of its own argument syntax, which
    xgrammar has no enabled built-in for) under the xgrammar vLLM runs, with the real Gemma 4
    vocabulary: every call the official template writes for a chosen tool is accepted token
    by token up to the stop token the model ends a calling turn with (`<|tool_response>`);
    a call missing a required argument, with a value outside its enum, or (named) of
    another tool, is not."""
    folder = gemma4_dir()
    model = load_model(str(folder))
    declared = [PING, NOTE, PLAN_TRIP]
    tools = [Tool(**t["function"]) for t in declared]

    def template_call(name: str, arguments: dict[str, object]) -> list[int]:
        call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
        messages = [{"role": "user", "content": "Go."},
                    {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
        text = model.tokenizer.apply_chat_template(messages, tools=declared, tokenize=False)
        start, end = text.index("<|tool_call>"), text.rindex("<tool_call|>") + len("<tool_call|>")
        return [*model.encode(text[start:end]), model.tokenizer.get_vocab()["<|tool_response>"]]

    full = {"city": "Zürich", "units": "metric", "days": 3, "Budget": 12.5,
            "flags": [True, False], "stay": {"hotel": "Ritz <b>", "nights": 2},
            "notes": {"a": [1, "x"]}}  # fmt: skip
    calls = {
        "full": template_call("plan_trip", full),
        "required only": template_call("plan_trip", {"city": "Paris", "units": "imperial"}),
        "missing a required argument": template_call("plan_trip", {"city": "Paris"}),
        "outside the enum": template_call("plan_trip", {"city": "Paris", "units": "kelvin"}),
        "another tool": template_call("note", {"ok": True}),
    }
    required = tool_choice_constraint(model, tools, "required")
    named = tool_choice_constraint(model, tools, {"name": "plan_trip"})
    assert required is not None and named is not None
    cases = [(choice, call) for choice in ("required", "named") for call in calls]
    job = {
        "tokenizer": str(folder),
        "stops": model.stop_token_ids,
        "cases": [
            {
                "tag": (required if choice == "required" else named)["structural_tag"],
                "ids": calls[call],
            }
            for choice, call in cases
        ],
    }
    walked = subprocess.run(
        [str(localengine.install()), "-c", _XGRAMMAR_WALK],
        input=json.dumps(job), capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    verdicts = dict(zip(cases, json.loads(walked.stdout), strict=True))
    accepted = {"full", "required only"}
    assert verdicts == {
        (choice, call): call in accepted or (choice, call) == ("required", "another tool")
        for choice, call in cases
    }
