"""`chat_template_kwargs` (vLLM's Chat Completions field, and a session default): the
variables reach the chat template on every turn, so Qwen3's `enable_thinking: false` and
Gemma 4's `enable_thinking: true` render the template's own generation prompt, and later
turns continue the stored tokens in one segment.

Real tokenizers and official templates (tests/real_tokenizers.py), the openai SDK, and
`session_server.check.ScriptedEngine` (an in-process engine that replays scripted
completions; no vLLM serves these models here), as in tests/session/test_family_paths.py;
the store test runs the session tier's HTTP engine double on memory and real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest

from session_server import check
from session_server.check import load_model
from session_server.check.scenarios import Completion
from session_server.splice import ChatModel
from tests.engine_double import ScriptedCompletion
from tests.real_tokenizers import gemma4_dir
from tests.session.conftest import Stack
from tests.session.test_family_paths import Loop


@pytest.fixture
def qwen3(qwen3_model: ChatModel) -> ChatModel:
    return qwen3_model  # the session tier's (tests/session/conftest.py), loaded once


@pytest.fixture(scope="module")
def gemma4() -> ChatModel:
    return load_model(str(gemma4_dir()))


def template_prompt(model: ChatModel, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The official template's own prompt for `messages`, with `kwargs`."""
    text = model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return list(model.tokenizer.encode(text, add_special_tokens=False))


def reply(loop: Loop, text: str) -> Completion:
    return Completion(loop.scripter.spell(text) + loop.scripter.close())


def client(loop: Loop, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key="x",
        base_url=f"http://t/sessions/{session}/v1",
        max_retries=0,
        http_client=loop.http(),
    )


def test_qwen3_thinking_off_on_a_request_and_over_a_session_default(qwen3: ChatModel) -> None:
    """A session created with `enable_thinking: false`: every turn's prompt is the
    template's with thinking off (the empty think block), two turns stay one segment; a
    request's own `enable_thinking: true` wins over the default for that turn."""
    loop = Loop(qwen3)
    loop.engine.script(reply(loop, "Hello."), reply(loop, "Sunny."), reply(loop, "Yes."))
    off = {"enable_thinking": False}

    async def run() -> list[dict[str, Any]]:
        async with loop.http() as http:
            made = await http.post("http://t/sessions", json={"chat_template_kwargs": off})
            assert made.status_code == 201, made.text
            session = made.json()
            assert session["chat_template_kwargs"] == off
        sdk = client(loop, session["id"])
        history: list[dict[str, Any]] = [{"role": "user", "content": check.FIRST_USER}]
        one = await sdk.chat.completions.create(model="m", messages=history)
        history.append({"role": "assistant", "content": one.choices[0].message.content})
        history.append({"role": "user", "content": "And tomorrow?"})
        await sdk.chat.completions.create(model="m", messages=history)
        # The request's own value wins (a new session: no stored turn to continue).
        await client(loop, "qwen3-thinking-on").chat.completions.create(
            model="m", messages=history[:1], extra_body={"chat_template_kwargs": off}
        )
        return history

    history = asyncio.run(run())
    first, second, third = loop.engine.prompts
    assert first == template_prompt(qwen3, history[:1], enable_thinking=False)
    assert qwen3.decode(first).endswith("<think>\n\n</think>\n\n")
    assert first != template_prompt(qwen3, history[:1])
    stored = first + loop.scripter.spell("Hello.") + loop.scripter.close()
    assert second[: len(stored)] == stored, "a new segment: the turn was not continued"
    assert qwen3.decode(second).endswith("<think>\n\n</think>\n\n")
    assert qwen3.decode(second[len(stored) :]).count("And tomorrow?") == 1
    assert third == first


def test_qwen3_request_overrides_the_session_default_key_by_key(qwen3: ChatModel) -> None:
    loop = Loop(qwen3)
    loop.engine.script(reply(loop, "Hello."))

    async def run() -> None:
        async with loop.http() as http:
            made = await http.post(
                "http://t/sessions",
                json={"id": "override", "chat_template_kwargs": {"enable_thinking": False}},
            )
            assert made.status_code == 201, made.text
        await client(loop, "override").chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": check.FIRST_USER}],
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )

    asyncio.run(run())
    user = [{"role": "user", "content": check.FIRST_USER}]
    assert loop.engine.prompts == [template_prompt(qwen3, user, enable_thinking=True)]


def test_gemma4_thinking_on_renders_the_templates_prompt_and_parses_the_thought(
    gemma4: ChatModel,
) -> None:
    """Gemma 4's generation prompt closes an empty thought channel unless
    `enable_thinking` is on: with it on, the prompt is the template's own, and a reply that
    thinks first comes back with the thought as `reasoning_content`."""
    loop = Loop(gemma4)
    # Canonical tokens: the renderer reads the channel's name (`thought\n`) as its tokens.
    thinks = "<|channel>thought\nThe user wants the weather.<channel|>Sunny."
    sampled = gemma4.tokenizer.encode(thinks, add_special_tokens=False) + loop.scripter.close()
    loop.engine.script(Completion(sampled), reply(loop, "Yes."))
    user = [{"role": "user", "content": check.FIRST_USER}]

    async def run() -> Any:
        sdk = client(loop, "gemma-thinks")
        on = {"chat_template_kwargs": {"enable_thinking": True}}
        one = await sdk.chat.completions.create(model="m", messages=user, extra_body=on)
        history = [
            *user,
            {"role": "assistant", "content": one.choices[0].message.content},
            {"role": "user", "content": "Tomorrow too?"},
        ]
        await sdk.chat.completions.create(model="m", messages=history, extra_body=on)
        return one

    one = asyncio.run(run())
    first, second = loop.engine.prompts
    assert first == template_prompt(gemma4, user, enable_thinking=True)
    assert first != template_prompt(gemma4, user)
    message = one.choices[0].message
    assert message.content == "Sunny."
    assert (message.model_extra or {}).get("reasoning_content") == "The user wants the weather."
    stored = first + sampled
    assert second[: len(stored)] == stored, "a new segment: the turn was not continued"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ("enable_thinking", "chat_template_kwargs"),
        ({"tokenize": True}, "tokenize"),
        ({"pad": "x" * 9000}, "8192"),
    ],
)
def test_bad_template_kwargs_are_refused_and_nothing_is_stored(
    qwen3: ChatModel, kwargs: Any, says: str
) -> None:
    loop = Loop(qwen3)
    loop.engine.script(reply(loop, "Hello."))

    async def run() -> None:
        async with loop.http() as http:
            made = await http.post(
                "http://t/sessions", json={"id": "bad", "chat_template_kwargs": kwargs}
            )
            assert made.status_code == 400, made.text
            assert says in made.text
            assert (await http.get("http://t/sessions/bad")).status_code == 404
        sdk = client(loop, "bad-turn")
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Hi"}],
                extra_body={"chat_template_kwargs": kwargs},
            )
        assert says in str(refused.value)
        assert refused.value.body["param"] is not None  # the API's own error shape
        async with loop.http() as http:
            stored = await http.get("http://t/sessions/bad-turn")
            assert stored.status_code == 404 or stored.json()["turn_count"] == 0

    asyncio.run(run())
    assert loop.engine.prompts == []


def test_messages_thinking_turns_gemma4s_thinking_on(gemma4: ChatModel) -> None:
    """Anthropic Messages' `thinking: {"type": "enabled"}` is `enable_thinking: true` for a
    template that reads it: the thought comes back as a thinking block."""
    loop = Loop(gemma4)
    thinks = "<|channel>thought\nThe user wants the weather.<channel|>Sunny."
    loop.engine.script(
        Completion(
            gemma4.tokenizer.encode(thinks, add_special_tokens=False) + loop.scripter.close()
        )
    )

    async def run() -> Any:
        sdk = anthropic.AsyncAnthropic(
            api_key="x", base_url="http://t/sessions/gemma-msg", max_retries=0,
            http_client=loop.http(),
        )  # fmt: skip
        return await sdk.messages.create(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": check.FIRST_USER}],
            thinking={"type": "enabled", "budget_tokens": 1024},
        )

    message = asyncio.run(run())
    user = [{"role": "user", "content": check.FIRST_USER}]
    assert loop.engine.prompts == [template_prompt(gemma4, user, enable_thinking=True)]
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user wants the weather."


def test_responses_take_the_session_default(qwen3: ChatModel) -> None:
    """Both turns, the second continued by `previous_response_id` (the template renders the
    new item after a stand-in history): thinking off, one segment."""
    loop = Loop(qwen3)
    loop.engine.script(reply(loop, "Hello."), reply(loop, "Sunny."))

    async def run() -> None:
        async with loop.http() as http:
            made = await http.post(
                "http://t/sessions",
                json={"id": "responses", "chat_template_kwargs": {"enable_thinking": False}},
            )
            assert made.status_code == 201, made.text
        sdk = client(loop, "responses")
        one = await sdk.responses.create(model="m", input=check.FIRST_USER)
        await sdk.responses.create(model="m", input="And tomorrow?", previous_response_id=one.id)

    asyncio.run(run())
    user = [{"role": "user", "content": check.FIRST_USER}]
    first, second = loop.engine.prompts
    assert first == template_prompt(qwen3, user, enable_thinking=False)
    stored = first + loop.scripter.spell("Hello.") + loop.scripter.close()
    assert second[: len(stored)] == stored, "a new segment: the turn was not continued"
    assert qwen3.decode(second[len(stored) :]).endswith(
        "And tomorrow?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_the_session_default_is_kept_by_both_stores(stack: Stack) -> None:
    """Stored with the session (memory and Redis): read back by every turn and shown by
    GET /sessions/{id}."""
    off = {"enable_thinking": False}
    with stack.http() as http:
        made = http.post("/sessions", json={"id": "kept", "chat_template_kwargs": off})
        assert made.status_code == 201, made.text
        assert http.get("/sessions/kept").json()["chat_template_kwargs"] == off
    user = [{"role": "user", "content": check.FIRST_USER}]
    stack.double.script(ScriptedCompletion(stack.model.encode("Hello.")))
    stack.openai("kept").chat.completions.create(model=stack.double.model, messages=user)
    assert stack.prompts() == [template_prompt(stack.model, user, enable_thinking=False)]
