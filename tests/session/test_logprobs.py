"""`logprobs: true` returns the engine's numbers for the tokens it sampled, through the
official OpenAI SDK, streamed and not; what tokenkeep cannot return is refused with a 400."""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest

from tests.engine_double import ScriptedCompletion
from tests.session.conftest import Stack
from tests.trajectory_values import assert_trajectory_values

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _sampled(stack: Stack) -> list[int]:
    # Non-round values that differ per position, so a shift by one cannot pass.
    return stack.model.encode("It is sunny, 21 degrees.") + stack.model.stop_token_ids[:1]


def _values(tokens: list[int]) -> list[float]:
    return [-(0.013 + 0.37 * i + (t % 11) / 7) for i, t in enumerate(tokens)]


def _f32(values: list[float]) -> list[float]:
    return [float(np.float32(v)) for v in values]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_engines(stack: Stack, stream: bool) -> None:
    sampled = _sampled(stack)
    values = _values(sampled)
    stack.double.script(ScriptedCompletion(sampled, logprobs=values))
    client = stack.openai(f"lp-{stream}")
    if stream:
        entries = []
        for chunk in client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            logprobs=True,
            stream=True,  # type: ignore[arg-type]
        ):
            for choice in chunk.choices:
                if choice.logprobs and choice.logprobs.content:
                    entries += choice.logprobs.content
    else:
        reply = client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            logprobs=True,  # type: ignore[arg-type]
        )
        assert reply.choices[0].logprobs is not None
        entries = list(reply.choices[0].logprobs.content or [])
    assert [e.logprob for e in entries] == values  # the engine's numbers, position by position
    assert [e.token for e in entries] == [stack.model.decode([t]) for t in sampled]
    assert all(e.top_logprobs == [] for e in entries)
    # ...and the same values reach the trainer (the stores keep float32).
    trajectory = stack.trajectory(f"lp-{stream}")
    assert_trajectory_values(trajectory, stack.double.samples, every_sample=True)
    [segment] = trajectory["branches"][0]["segments"]
    assert [lp for lp in segment["logprobs"] if lp is not None] == _f32(values)


def test_chat_without_logprobs_has_none(stack: Stack) -> None:
    stack.double.script(ScriptedCompletion(_sampled(stack)))
    reply = stack.openai("lp-off").chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.choices[0].logprobs is None


def test_top_logprobs_alternatives_are_refused(memory_stack: Stack) -> None:
    client = memory_stack.openai("lp-top")
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            logprobs=True,
            top_logprobs=2,
        )
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == "top_logprobs"  # type: ignore[index]
    assert "top_logprobs" in raised.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="m", input="Hi", top_logprobs=2)
    assert raised.value.body["param"] == "top_logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="m", input="Hi", include=["message.output_text.logprobs"])
    assert raised.value.body["param"] == "include"  # type: ignore[index]
    # Nothing was sent to the engine, nothing stored.
    assert memory_stack.double.requests == []
    with memory_stack.http() as http:
        assert http.get("/sessions/lp-top").status_code == 404
    # top_logprobs: 0 asks for no alternatives: accepted.
    memory_stack.double.script(ScriptedCompletion(_sampled(memory_stack)))
    reply = client.chat.completions.create(
        model="m",
        messages=MESSAGES,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=0,
    )
    assert reply.choices[0].logprobs is not None
    assert not any(math.isnan(e.logprob) for e in reply.choices[0].logprobs.content or [])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_logprobs_are_the_engines(stack: Stack, stream: bool) -> None:
    """Token-ID clients (`/v1/completions`, `logprobs: 0`) get the engine's numbers too."""
    sampled = _sampled(stack)
    values = _values(sampled)
    stack.double.script(ScriptedCompletion(sampled, logprobs=values))
    prompt = stack.model.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    client = stack.openai(f"lp-cmpl-{stream}")
    if stream:
        got: list[float | None] = []
        for chunk in client.completions.create(
            model="m", prompt=prompt, logprobs=0, max_tokens=50, stream=True
        ):
            for choice in chunk.choices:
                if choice.logprobs:
                    got += choice.logprobs.token_logprobs or []
    else:
        reply = client.completions.create(model="m", prompt=prompt, logprobs=0, max_tokens=50)
        assert reply.choices[0].logprobs is not None
        got = list(reply.choices[0].logprobs.token_logprobs or [])
    assert got == values
    trajectory = stack.trajectory(f"lp-cmpl-{stream}")
    assert_trajectory_values(trajectory, stack.double.samples, every_sample=True)
