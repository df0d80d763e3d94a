"""Every scripted completion of the test corpus, in the syntax of the family that samples it.

The adversarial scenarios (tests/session/adversarial.py) are written in Qwen3/Hermes syntax;
here they are joined by Llama 3's bare-JSON tool calls and by the shapes a stream must get
right at its edges: a reply truncated inside a tool call or inside reasoning, literal markers
spelled in sub-words, partial UTF-8, whitespace a parser strips."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from session_server.splice import ChatModel
from tests.session.adversarial import END, SCENARIOS, tokens


@dataclass(frozen=True)
class Reply:
    name: str
    completion: Callable[[ChatModel], list[int]]
    finish_reason: str = "stop"


def _call(body: str) -> Callable[[ChatModel], list[int]]:
    return lambda m: tokens(m, "<tool_call>", "\n", body, "\n", "</tool_call>", END)


_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
_LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'

EXTRA: list[Reply] = [
    Reply(
        "text_then_tool_call",
        lambda m: tokens(
            m, "Let me check.", "\n", "<tool_call>", "\n", _WEATHER, "\n", "</tool_call>", END
        ),
    ),
    Reply(
        "two_tool_calls",
        lambda m: tokens(
            m,
            "<tool_call>",
            "\n",
            _WEATHER,
            "\n",
            "</tool_call>",
            "\n",
            "<tool_call>",
            "\n",
            '{"name": "calc", "arguments": {"x": 1, "y": 2}}',
            "\n",
            "</tool_call>",
            END,
        ),
    ),
    Reply(
        "reasoning_then_tool_call",
        lambda m: tokens(
            m,
            "<think>",
            "\nNeed weather.\n",
            "</think>",
            "\n\n",
            "<tool_call>",
            "\n",
            _WEATHER,
            "\n",
            "</tool_call>",
            END,
        ),
    ),
    Reply(
        "truncated_inside_tool_call",
        lambda m: tokens(m, "<tool_call>", "\n", '{"name": "get_weather", "argu'),
        finish_reason="length",
    ),
    Reply(
        "truncated_inside_reasoning",
        lambda m: tokens(m, "<think>", "\nStill thin", "king"),
        finish_reason="length",
    ),
    Reply("malformed_tool_call_json", _call('{"name": "get_weather", "arguments": {"city": ')),
    Reply("unknown_tool_name", _call('{"name": "nope", "arguments": {}}')),
    Reply(
        "literal_think_in_subwords",
        lambda m: tokens(m, "Use ", "<", "/", "think", ">", " to close.", END),
    ),
    Reply("trailing_whitespace", lambda m: tokens(m, "Done.", "  ", "\n\n", END)),
    Reply("whitespace_only", lambda m: tokens(m, " ", "\n", END)),
    Reply("empty", lambda m: tokens(m, END)),
    Reply("utf8_split_at_end", lambda m: tokens(m, "Cost ", b"\xe2\x82", b"\xac", END)),
    Reply("llama_tool_call", lambda m: tokens(m, _LLAMA_WEATHER, END)),
    Reply(
        "llama_tool_call_in_pieces",
        lambda m: tokens(
            m, "{", '"name"', ": ", '"calc"', ", ", '"parameters"', ": {", '"x": 1', "}}", END
        ),
    ),
    Reply("llama_tool_call_leading_whitespace", lambda m: tokens(m, "\n\n", _LLAMA_WEATHER, END)),
    Reply(
        "llama_truncated_tool_call",
        lambda m: tokens(m, '{"name": "get_weather", "par'),
        finish_reason="length",
    ),
    Reply("json_text_not_a_call", lambda m: tokens(m, '{"answer": 42}', END)),
    Reply("brace_later_in_text", lambda m: tokens(m, "Use ", "{", "x", "}", " here.", END)),
    Reply("json_then_text", lambda m: tokens(m, _LLAMA_WEATHER, " done", END)),
]

CORPUS: list[Reply] = [
    *(Reply(s.name, s.completion, s.finish_reason) for s in SCENARIOS),
    *EXTRA,
]
