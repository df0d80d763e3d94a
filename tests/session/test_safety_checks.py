"""The two safety checks, made to fire: the engine's report of the prompt it received, and
the proof that a bridge kept every stored token. Faults are injected into otherwise real
parts: the engine double's prompt report (`report_prompt`), the real Qwen3 renderer's bridge
output, and the chat template's rendering the generic splice cuts from. Each gives the
documented error or break reason, leaves stored history as it was, and is counted."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from session_server.splice import GENERIC, ChatModel
from session_server.tokenizer import load_tokenizer
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import qwen3_dir
from tests.session.adversarial import END, reply_as_harness_sends, tokens
from tests.session.conftest import Stack, make_stack

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _say(stack: Stack, *pieces: Any) -> None:
    stack.double.script(ScriptedCompletion(tokens(stack.model, *pieces, END)))


def _metric(stack: Stack, line_start: str) -> float:
    with stack.http() as http:
        text = http.get("/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


def _first_turn(stack: Stack, session_id: str) -> list[dict[str, Any]]:
    _say(stack, "Sun", "ny")
    first = stack.openai(session_id).chat.completions.create(model="m", messages=USER)
    return [*USER, reply_as_harness_sends(first.choices[0].message)]


def _swap_one_token(prompt: list[int]) -> list[int]:
    """The prompt with one early token changed, as a re-tokenizing engine would report it."""
    changed = list(prompt)
    changed[3] = changed[3] + 1
    return changed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_engine_reporting_another_prompt_fails_and_stores_nothing(
    stack: Stack, stream: bool
) -> None:
    session_id = f"proof-{'stream' if stream else 'whole'}"
    history = [*_first_turn(stack, session_id), {"role": "user", "content": "And tomorrow?"}]
    before = stack.trajectory(session_id)
    stack.double.report_prompt = _swap_one_token
    _say(stack, "Rain")
    client = stack.openai(session_id)
    with pytest.raises(openai.APIStatusError) as failed:
        if stream:
            for _ in client.chat.completions.create(model="m", messages=history, stream=True):
                pass
        else:
            client.chat.completions.create(model="m", messages=history)
    assert failed.value.status_code == 502
    error = failed.value.body
    assert isinstance(error, dict)
    assert "differs from the spliced prompt" in error["message"]
    assert error["type"] == "engine_error"
    assert stack.trajectory(session_id) == before, "a refused turn changed stored history"
    assert _metric(stack, "tokenkeep_proof_failures_total") == 1

    # The check refused the engine's report, not the history: the same request goes on.
    stack.double.report_prompt = None
    _say(stack, "Rain")
    again = client.chat.completions.create(model="m", messages=history)
    assert again.model_extra["tokenkeep"]["kind"] == "extend"


def test_a_bridge_that_alters_a_stored_token_is_refused(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The family renderer's bridge returns the stored tokens with one changed: the splice
    proof rejects it, the turn starts a new segment with reason `bridge_unproven` (counted),
    and the stored turn is untouched."""
    history = [*_first_turn(stack, "unproven"), {"role": "user", "content": "And tomorrow?"}]
    (stored_segment,) = stack.trajectory("unproven")["branches"][0]["segments"]
    renderer = stack.model.renderer
    bridge = renderer.bridge_to_next_turn

    def altering_bridge(prompt_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        rendered = bridge(prompt_ids, *args, **kwargs)
        altered = list(rendered.token_ids)
        altered[len(prompt_ids) - 1] += 1  # the last stored prompt token
        return dataclasses.replace(rendered, token_ids=altered)

    monkeypatch.setattr(renderer, "bridge_to_next_turn", altering_bridge)
    _say(stack, "Rain")
    reply = stack.openai("unproven").chat.completions.create(model="m", messages=history)
    assert reply.model_extra["tokenkeep"]["kind"] == "rewrite"
    assert reply.model_extra["tokenkeep"]["break_reason"] == "bridge_unproven"
    assert _metric(stack, 'tokenkeep_segment_breaks_total{reason="bridge_unproven"}') == 1
    # The engine got the new segment's own prompt (a whole render of the request), which
    # starts like the first turn's prompt: the altered token never reached it.
    first_prompt, sent = stack.prompts()[0], stack.prompts()[-1]
    assert sent[: len(first_prompt)] == first_prompt
    segments = [s for b in stack.trajectory("unproven")["branches"] for s in b["segments"]]
    assert [s["start_reason"] for s in segments] == ["first", "bridge_unproven"]
    assert segments[0]["token_ids"] == stored_segment["token_ids"]
    assert segments[1]["token_ids"][: len(sent)] == sent


@pytest.fixture
def generic_stack(engine_double: EngineDouble) -> Iterator[Stack]:
    yield from make_stack(
        ChatModel(load_tokenizer(str(qwen3_dir())), GENERIC), engine_double, "memory", None
    )


def test_a_generic_splice_that_loses_a_new_message_is_refused(
    generic_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generic splice cuts the template's rendering after the stored turn's close; a
    rendering that lost the new message's text (here: the template leaves it out) must not
    be spliced in: `bridge_unproven`, counted, a new segment."""
    stack = generic_stack
    history = [*_first_turn(stack, "lost"), {"role": "user", "content": "And tomorrow?"}]
    model = stack.model
    apply_template = model._apply_template

    def losing_template(messages: list[Any], tools: list[Any], **kwargs: Any) -> list[int]:
        if messages[-1].content == "And tomorrow?":
            messages = [*messages[:-1], dataclasses.replace(messages[-1], content="")]
        return apply_template(messages, tools, **kwargs)

    monkeypatch.setattr(model, "_apply_template", losing_template)
    _say(stack, "Rain")
    reply = stack.openai("lost").chat.completions.create(model="m", messages=history)
    assert reply.model_extra["tokenkeep"]["kind"] == "rewrite"
    assert reply.model_extra["tokenkeep"]["break_reason"] == "bridge_unproven"
    assert _metric(stack, 'tokenkeep_segment_breaks_total{reason="bridge_unproven"}') == 1
