"""The generic path learns a template's tool-call syntax from the template itself
(`session_server/toolsyntax.py`) and parses calls in it, token-exact, streamed = plain.

Real tokenizers with official templates, offline (tests/real_tokenizers.py): DeepSeek V3.2's
DSML (one element per parameter, llama.cpp's template), MiniMax M3 (`<city>Paris</city>`
elements), functionary v3.1 (`<function=name>{json}</function>`, markers in plain text). The
engine is `ScriptedEngine`, an in-process implementation of the engine-client interface
that "samples" completions scripted in the family's own syntax (no vLLM can serve these
models here). DeepSeek V3.1 / R1-0528 run the SDK tool loops in test_family_paths.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from session_server import check
from session_server.app import build_service
from session_server.check import SCENARIOS, TOOL, ScriptedEngine, Scripter, load_model
from session_server.conversation import ConversationError, Message, Tool
from session_server.engines import EngineClient
from session_server.reply_split import ReplyStreamer
from session_server.settings import Settings
from session_server.splice import GENERIC, ChatModel
from session_server.store.memory import MemoryStore
from session_server.tool_choice import tool_choice_constraint
from tests.real_tokenizers import llama32_dir, offline_counter_dir, unlearnable_dir

# folder, what the learned syntax opens a call with, argument style
LEARNED: dict[str, tuple[Callable[[], Path], str, str]] = {
    "deepseek-v3.2": (
        lambda: offline_counter_dir("deepseek-v3.2", llama_cpp="deepseek-ai-DeepSeek-V3.2.jinja"),
        "<｜DSML｜function_calls>",
        "per-parameter elements",
    ),
    "minimax-m3": (
        lambda: offline_counter_dir("minimax-m3"),
        "<tool_call>",
        "per-parameter elements",
    ),
    "functionary-v3.1": (
        lambda: _llama_with("meetkai-functionary-medium-v3.1.jinja"),
        "<function=",
        "JSON arguments",
    ),
}
TOOL_CALL = next(s for s in SCENARIOS if s.name == "tool_call")


def _calls(city: str) -> list[dict[str, Any]]:
    arguments = {"city": city}
    return [
        {
            "id": "a1B2c3D4e",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }
    ]


def _llama_with(template: str) -> Path:
    """The Llama 3.2 tokenizer with another llama.cpp template of the family."""
    from tests.real_tokenizers import CACHE, llama_cpp_templates

    target = CACHE / f"llama-3.2--{template}"
    if not (target / "tokenizer_config.json").exists():
        source = llama32_dir()
        target.mkdir(parents=True, exist_ok=True)
        (target / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
        config = json.loads((source / "tokenizer_config.json").read_text())
        config["chat_template"] = (llama_cpp_templates() / template).read_text()
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module", params=list(LEARNED))
def learned(request: pytest.FixtureRequest) -> tuple[str, ChatModel]:
    directory, _, _ = LEARNED[request.param]
    return request.param, load_model(str(directory()))


def test_the_generic_path_learns_the_syntax_and_says_so(learned: tuple[str, ChatModel]) -> None:
    name, model = learned
    _, opener, style = LEARNED[name]
    assert model.family == GENERIC
    assert model.learned_calls is not None, model.path.reason
    assert "tool calls parsed in the syntax learned from the template" in model.path.reason
    assert opener in model.path.reason and style in model.path.reason


def test_three_turn_loop_on_every_api_parses_calls(learned: tuple[str, ChatModel]) -> None:
    """The check corpus, 3 turns on Chat Completions, Responses and Messages, streamed and
    not: calls arrive as calls (name and arguments), streams equal plain replies, every turn
    continues the stored tokens."""
    _, model = learned
    report = asyncio.run(check.run_check(model))
    assert report.contiguous, [r.reason for r in report.rows if not r.contiguous]
    assert report.tool_calls_parsed is True, [
        r.reason for r in report.rows if r.calls_parsed is False
    ]
    assert report.stream_equal is True, [r.reason for r in report.rows if r.stream_equal is False]


def test_content_before_a_text_marker_call_streams_without_the_call() -> None:
    """functionary's `<function=` is plain text: the streamer holds it from its first
    character, so the streamed content is the parsed content, token by token."""
    model = load_model(str(_llama_with("meetkai-functionary-medium-v3.1.jinja")))
    scripter = Scripter(model)
    reply = {"role": "assistant", "content": "Let me check.", "tool_calls": _calls("Paris")}
    body, why = scripter.assistant_text(reply, True)
    assert body is not None and body.startswith("Let me check.<function="), why
    ids = scripter.spell(body)
    prompt = model.render_prompt([Message(role="user", content=check.FIRST_USER)], [Tool(**TOOL)])
    parsed = model.parse(ids, "stop", prompt, [Tool(**TOOL)]).message
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    streamer = ReplyStreamer(model, prompt)
    streamed = ""
    for token in ids:
        streamed += streamer.feed([token]).content
        assert "<" not in streamed, streamed
    streamed += streamer.finish(parsed).content
    assert streamed == parsed.content


@pytest.mark.parametrize("name", ["deepseek-v3.2", "functionary-v3.1"])
def test_tool_choice_forces_the_templates_own_call(name: str) -> None:
    """`tool_choice` required / named: the structural tag, filled in, is the template's own
    rendering of the call, and the parser reads it back as that call."""
    model = load_model(str(LEARNED[name][0]()))
    tools = [Tool(**TOOL)]
    for choice in ("required", {"name": "get_weather"}):
        constraint = tool_choice_constraint(model, tools, choice)
        assert constraint is not None
        tag = json.loads(constraint["structural_tag"])["format"]
        forced = _fill(model, tag, {"city": "Zürich"})
        body, _ = Scripter(model).assistant_text(
            {"role": "assistant", "content": "", "tool_calls": _calls("Zürich")}, True
        )
        # (from after the reasoning block, where vLLM applies the constraint)
        assert body is not None
        assert forced == body.split("</think>")[-1].replace("\\u00fc", "ü")
        parsed = model.parse(model.encode(forced), "stop", [], tools).message
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": "Zürich"})
        ]


def _fill(model: ChatModel, tag: dict[str, Any], arguments: dict[str, Any]) -> str:
    """The text a sampler under `tag` writes for `arguments`."""
    values = iter(arguments.values())
    out = ""
    for element in tag["elements"]:
        if element["type"] == "token":
            out += model.decode([element["token"]])
        elif element["type"] == "const_string":
            out += element["value"]
        elif element["type"] == "json_schema":
            out += json.dumps(arguments, ensure_ascii=False)
        else:  # a string parameter's value
            assert element["type"] == "regex"
            out += str(next(values))
    return out


def test_a_syntax_that_cannot_be_learned_is_named_everywhere(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Calls written `name(key=value)` have no markers to learn: the path says so, serve
    warns with it and starts on the generic path, `check` exits 2, tool_choice is a 400
    naming the family."""
    folder = str(unlearnable_dir())
    model = load_model(folder)
    assert model.family == GENERIC and model.learned_calls is None
    assert "TOOL-CALL SYNTAX NOT LEARNED" in model.path.reason
    with caplog.at_level(logging.WARNING, logger="tokenkeep"):
        build_service(
            Settings(model="m", tokenizer="", renderer="auto"),
            store=MemoryStore(),
            model=model,
            engine=cast(EngineClient, ScriptedEngine()),
        )
    assert any("TOOL-CALL SYNTAX NOT LEARNED" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConversationError, match=r"cannot be enforced.*generic"):
        tool_choice_constraint(model, [Tool(**TOOL)], "required")
    level = logging.getLogger("tokenkeep").level
    assert check.main(["--tokenizer", folder]) == 2
    # Quiet while it ran, as it was afterwards: a server in the same process still logs.
    assert logging.getLogger("tokenkeep").level == level
    assert "TOOL-CALL SYNTAX NOT LEARNED" in capsys.readouterr().err


def test_learned_reasoning_markers_stream_as_they_parse() -> None:
    """MiniMax M3 writes `<mm:think>...</mm:think>` (learned from its template): a block that
    opens the reply is reasoning (also cut off before its closer, or after whitespace), the
    closer alone is the template's empty block, a marker later in the reply is the parser's
    text; the streamed text, token by token, is the parsed reply."""
    model = load_model(str(LEARNED["minimax-m3"][0]()))
    assert model.reasoning_markers == ("<mm:think>", "</mm:think>")
    scripter = Scripter(model)
    prompt = model.render_prompt([Message(role="user", content=check.FIRST_USER)], [])
    cases = {
        "<mm:think>Rain is unlikely.</mm:think>Sunny.": ("Rain is unlikely.", "Sunny."),
        "\n<mm:think>Rain is unlikely.</mm:think>Sunny.": ("Rain is unlikely.", "Sunny."),
        "</mm:think>Sunny.": (None, "Sunny."),
        "<mm:think>Rain is unlik": ("Rain is unlik", ""),
        "Sunny.</mm:think> ok": (None, "Sunny.</mm:think> ok"),
    }
    for body, (reasoning, content) in cases.items():
        ids = scripter.spell(body)
        parsed = model.parse(ids, "length", prompt, []).message
        assert (parsed.reasoning, parsed.content) == (reasoning, content), body
        streamer = ReplyStreamer(model, prompt)
        streamed = {"content": "", "reasoning": ""}
        for token in ids:
            delta = streamer.feed([token])
            streamed["content"] += delta.content
            streamed["reasoning"] += delta.reasoning
            assert content.startswith(streamed["content"]), body
            assert (reasoning or "").startswith(streamed["reasoning"]), body
        tail = streamer.finish(parsed)
        assert streamed["content"] + tail.content == content, body
        assert streamed["reasoning"] + tail.reasoning == (reasoning or ""), body
