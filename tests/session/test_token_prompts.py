"""/v1/completions for token-aware clients: the prompt is matched against stored tokens."""

from __future__ import annotations

import openai
import pytest

from tests.engine_double import ScriptedCompletion
from tests.session.adversarial import END, tokens
from tests.session.conftest import Stack


def _render(stack: Stack, text: str) -> list[int]:
    return stack.model.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def test_token_client_extends_its_own_turns(stack: Stack) -> None:
    client = stack.openai("tok")
    prompt1 = _render(stack, "Hi")
    sampled1 = tokens(stack.model, "Hel", "lo", END)
    stack.double.script(ScriptedCompletion(sampled1))
    first = client.completions.create(model="m", prompt=prompt1, max_tokens=50)
    assert first.choices[0].model_extra["token_ids"] == sampled1
    assert first.choices[0].text == "Hello"
    assert first.model_extra["tokenkeep"]["kind"] == "first"

    prompt2 = prompt1 + sampled1 + stack.model.encode("\n") + _render(stack, "More")
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Sure", END)))
    second = client.completions.create(model="m", prompt=prompt2, max_tokens=50)
    assert second.model_extra["tokenkeep"]["kind"] == "extend"
    assert stack.prompts()[-1] == prompt2

    stack.double.script(ScriptedCompletion(tokens(stack.model, "Again", END)))
    again = client.completions.create(model="m", prompt=prompt2, max_tokens=50)
    assert again.model_extra["tokenkeep"]["kind"] == "retry"

    (branch, _) = stack.trajectory("tok")["branches"]
    (segment,) = branch["segments"]
    assert segment["token_ids"][: len(prompt2)] == prompt2
    assert sum(segment["loss_mask"]) == len(sampled1) + len(tokens(stack.model, "Sure", END))

    stack.double.script(ScriptedCompletion(tokens(stack.model, "x", END)))
    other = client.completions.create(model="m", prompt=_render(stack, "Unrelated"), max_tokens=5)
    assert other.model_extra["tokenkeep"] == {
        "kind": "rewrite",
        "break_reason": "history_mismatch",
        "turn_ids": [4],
    }


def test_text_prompt_and_streaming(stack: Stack) -> None:
    client = stack.openai("tok-stream")
    sampled = tokens(stack.model, "Str", "eam", "ed", " text", b"\xc3", b"\xa9", END)
    stack.double.script(ScriptedCompletion(sampled))
    stream = client.completions.create(
        model="m",
        prompt="Once upon a time",
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, ids, usage, finish = "", [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
    assert text == "Streamed text\u00e9"
    assert ids == sampled
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == len(sampled)
    assert stack.prompts()[-1] == stack.model.encode("Once upon a time")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_token_requests(stack: Stack, body: dict, param: str) -> None:
    with stack.http() as http:
        response = http.post("/sessions/tok-bad/v1/completions", json={"model": "m", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert stack.double.requests == []


def test_sdk_raises_for_out_of_vocabulary(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError):
        stack.openai("tok-oov").completions.create(model="m", prompt=[10**9])
