"""Multi-turn tool-using conversations through the whole real stack, checked token by token
against what vLLM itself reports: contiguity, tool calls, reasoning, one segment per session.

The random-weights model samples sub-word soup; where a turn needs a tool call, the request
carries a grammar (`session_server.devtools.demo.tool_call_grammar`) so the engine really samples a
reasoning block and a hermes `<tool_call>` with the model's own special tokens."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from session_server.devtools.demo import TOOLS, answer_grammar, tool_call_grammar, weather
from tests.integration.conftest import TALLY, RealStack
from tests.integration.relay import Exchange
from tests.session.adversarial import naive_prompt
from tests.suffix_reference import assert_suffix
from tests.trajectory_values import assert_trajectory_values

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class Step:
    user: str | None  # a new user message before this turn
    city: str | None = None  # the tool call the grammar makes the model sample
    grammar: bool = True  # False: free sampling (random text, cut at max_tokens)
    stream: bool = False

    @property
    def kind(self) -> str:
        return "tool call" if self.city else "answer" if self.grammar else "free text"


SCRIPT = (
    Step("What is the weather in Paris?", city="Paris"),
    Step(None, grammar=False),
    Step("And in Tokyo?", city="Tokyo", stream=True),
    Step(None),
    Step("Thanks. Anything else?", grammar=False, stream=True),
)


@dataclass
class Turn:
    sent_messages: list[dict[str, Any]]
    prompt_ids: list[int]
    completion_ids: list[int]
    kind: str
    message: dict[str, Any]  # as the harness got it (content, reasoning, tool calls)
    exchange: Exchange


def _vocab(stack: RealStack) -> dict[str, int]:
    return dict(stack.model.tokenizer.get_vocab())


def _complete(
    client: Any, body: dict[str, Any]
) -> tuple[dict[str, Any], list[int], list[int], str]:
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    message = choice.message
    out = {
        "content": message.content or "",
        "reasoning_content": (message.model_extra or {}).get("reasoning_content"),
        "tool_calls": [c.model_dump() for c in message.tool_calls or ()],
    }
    extra = reply.model_extra or {}
    return (
        out,
        extra["prompt_token_ids"],
        choice.model_extra["token_ids"],
        extra["tokenkeep"]["kind"],
    )


def _stream(client: Any, body: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[int], str]:
    content, reasoning, calls = "", "", []
    prompt_ids: list[int] = []
    token_ids: list[int] = []
    kind = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        extra = chunk.model_extra or {}
        if "prompt_token_ids" in extra:
            prompt_ids = extra["prompt_token_ids"]
            kind = extra["tokenkeep"]["kind"]
        for choice in chunk.choices:
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            calls += [c.model_dump() for c in delta.tool_calls or ()]
    message = {"content": content, "reasoning_content": reasoning or None, "tool_calls": calls}
    return message, prompt_ids, token_ids, kind


def run_conversation(stack: RealStack, seed: int) -> tuple[str, list[Turn]]:
    http = stack.http()
    session = http.post(
        "/sessions", json={"id": f"it-{uuid.uuid4().hex}", "sampling": {"seed": seed}}
    )
    assert session.status_code == 201, session.text
    session_body = session.json()
    client = stack.openai(session_body)
    vocab = _vocab(stack)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant. Use the tools."}
    ]
    turns: list[Turn] = []
    for step in SCRIPT:
        if step.user:
            messages.append({"role": "user", "content": step.user})
        body: dict[str, Any] = {
            "model": stack.engine.served_model_name,
            "messages": [dict(m) for m in messages],
            "tools": TOOLS,
            "max_tokens": 128 if step.grammar else 24,
        }
        if step.grammar:
            grammar = (
                tool_call_grammar(vocab, "get_weather", {"city": [step.city]})
                if step.city
                else answer_grammar(vocab)
            )
            body["extra_body"] = {
                "structured_outputs": {"grammar": grammar},
                "reasoning_ended": True,
                "return_token_ids": True,
            }
        else:
            body["extra_body"] = {"return_token_ids": True}
        before = len(stack.relay.exchanges)
        message, prompt_ids, token_ids, kind = (_stream if step.stream else _complete)(client, body)
        [exchange] = stack.relay.exchanges[before:]
        turns.append(Turn(body["messages"], prompt_ids, token_ids, kind, message, exchange))
        # The harness echoes what it got, reasoning included (vLLM's field name).
        echoed: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if message["reasoning_content"]:
            echoed["reasoning_content"] = message["reasoning_content"]
        if message["tool_calls"]:
            echoed["tool_calls"] = message["tool_calls"]
        messages.append(echoed)
        for call in message["tool_calls"]:
            city = json.loads(call["function"]["arguments"])["city"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": weather(city)})
    return session_body["id"], turns


def _between(tokens: list[int], start: int, end: int) -> list[int]:
    assert tokens.count(start) == 1 and tokens.count(end) == 1, tokens
    return tokens[tokens.index(start) + 1 : tokens.index(end)]


@pytest.mark.parametrize("seed", [11, 22, 33])
def test_tool_conversation_is_token_exact_against_vllm(real_stack: RealStack, seed: int) -> None:
    session_id, turns = run_conversation(real_stack, seed)
    model, vocab = real_stack.model, _vocab(real_stack)

    for k, turn in enumerate(turns):
        # What the session server sent is what vLLM reports it received, and what the
        # harness was told; the tokens the harness got are the ones vLLM sampled.
        assert turn.exchange.sent_prompt == turn.prompt_ids
        assert turn.exchange.reported_prompt == turn.prompt_ids
        assert turn.exchange.sampled[0] == turn.completion_ids
        if k == 0:
            assert turn.kind == "first"
            continue
        previous = turns[k - 1]
        stored = previous.prompt_ids + previous.completion_ids
        assert turn.kind == "extend"
        assert turn.prompt_ids[: len(stored)] == stored, f"turn {k} is not contiguous"
        # ...and what follows the sampled tokens is the template's own text for the new
        # messages (`tests/suffix_reference.py`), not merely something.
        assert_suffix(
            model, turn.prompt_ids, stored, previous.completion_ids, turn.sent_messages, TOOLS
        )

        # A server without tokenkeep renders the whole history each turn: had it sent the
        # previous render and got the same tokens back, does this render continue them?
        TALLY.continued += 1
        naive_before = naive_prompt(model, previous.sent_messages, TOOLS) + previous.completion_ids
        naive = naive_prompt(model, turn.sent_messages, TOOLS)
        if naive[: len(naive_before)] != naive_before:
            at = next(
                i for i, (a, b) in enumerate(zip(naive, naive_before, strict=False)) if a != b
            )
            TALLY.broken.append(
                f"seed {seed} turn {k + 1} (after {SCRIPT[k - 1].kind}): sampled "
                f"{model.decode(naive_before[at : at + 6])!r}, "
                f"re-rendered {model.decode(naive[at : at + 6])!r}"
            )

    for step, turn in zip(SCRIPT, turns, strict=True):
        sampled = turn.completion_ids
        if not step.grammar:
            continue
        # The reasoning block the engine sampled is the reasoning the harness got.
        thought = model.decode(_between(sampled, vocab["<think>"], vocab["</think>"]))
        assert (turn.message["reasoning_content"] or "").strip() == thought.strip()
        if step.city is None:
            assert turn.message["tool_calls"] == []
            continue
        # The parsed tool call the harness received is the one the engine sampled.
        body = json.loads(
            model.decode(_between(sampled, vocab["<tool_call>"], vocab["</tool_call>"]))
        )
        [call] = turn.message["tool_calls"]
        assert call["function"]["name"] == body["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == body["arguments"] == {"city": step.city}

    with real_stack.http() as http:
        summary = http.get(f"/sessions/{session_id}").json()
        trajectory = http.get(f"/sessions/{session_id}/trajectory").json()
    assert (summary["turns"], summary["segments"], summary["breaks"]) == (len(SCRIPT), 1, {})
    [branch] = trajectory["branches"]
    [segment] = branch["segments"]
    last = turns[-1]
    assert segment["token_ids"] == last.prompt_ids + last.completion_ids
    # Every sampled position carries vLLM's own logprob and policy version for its token, and
    # only those positions are marked for the loss (the relay read them off vLLM's answers).
    samples = [sample for turn in turns for sample in turn.exchange.samples()]
    assert all(len(s.logprobs) == len(s.token_ids) for s in samples)
    checked = assert_trajectory_values(trajectory, samples, every_sample=True)
    assert checked == sum(len(t.completion_ids) for t in turns)


def test_structured_output_applies_from_the_first_token_when_asked(
    real_stack: RealStack,
) -> None:
    """Straight to vLLM (no relay): the harness asks for `reasoning_ended` like vLLM's own
    /generate, and the grammar must shape the reply."""
    from session_server.app import create_app
    from session_server.settings import Settings
    from tests.live_server import serving

    engine = real_stack.engine
    settings = Settings(
        engine_urls=[engine.url],
        model=engine.served_model_name,
        tokenizer=str(engine.model_dir),
        context_length=engine.max_model_len,
    )
    with serving(create_app(settings)) as url:
        import openai

        client = openai.OpenAI(base_url=f"{url}/sessions/direct/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=engine.served_model_name,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=64,
            seed=5,
            extra_body={
                "structured_outputs": {
                    "grammar": tool_call_grammar(
                        _vocab(real_stack), "get_weather", {"city": ["Paris"]}
                    )
                },
                "reasoning_ended": True,
            },
        )
    calls = reply.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]


def test_first_prompt_is_the_models_own_chat_template(real_stack: RealStack) -> None:
    from session_server.conversation import Message, Tool

    model = real_stack.model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tools = [
        Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
        for t in TOOLS
    ]
    rendered = model.render_prompt(
        [Message(role=m["role"], content=m["content"]) for m in messages], tools
    )
    assert rendered == naive_prompt(model, messages, TOOLS)
