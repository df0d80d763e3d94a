"""Non-canonical completions: token sequences a model really samples but that re-encoding
the decoded text does not give back. Each scenario is one mismatch class of DESIGN.md
("Why it exists") or one harness habit, as a completion plus what the harness sends back."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from session_server.check import byte_level_chars
from session_server.splice import ChatModel

END = "<end-of-turn>"
"""Stands for the model's own end-of-turn token (Qwen3 <|im_end|>, Llama 3 <|eot_id|>)."""

Piece = str | int | bytes


def tokens(model: ChatModel, *pieces: Piece) -> list[int]:
    """Encode each text piece on its own (forcing the split), special tokens by name,
    `END` as the end-of-turn token, raw bytes as byte-level tokens."""
    vocab = model.tokenizer.get_vocab()
    out: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            out.append(piece)
        elif piece == END:
            assert model.close_token_id is not None
            out.append(model.close_token_id)
        elif isinstance(piece, bytes):
            byte_chars = byte_level_chars()
            out.extend(vocab[byte_chars[b]] for b in piece)
        elif piece in vocab and piece.startswith("<") and piece.endswith(">"):
            out.append(vocab[piece])
        else:
            out.extend(model.encode(piece))
    return out


def naive_prompt(
    model: ChatModel, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """What a server without tokenkeep sends: the chat template over the whole history, as
    vLLM's chat endpoint renders it (tool-call arguments parsed back into objects)."""
    rendered = copy.deepcopy(messages)
    for m in rendered:
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            args = call["function"]["arguments"]
            if isinstance(args, str):
                call["function"]["arguments"] = json.loads(args)
    return list(
        model.tokenizer.apply_chat_template(
            rendered, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate numbers.",
            "parameters": {"type": "object", "properties": {"x": {}, "y": {}}},
        },
    },
]


def reply_as_harness_sends(message: Any) -> dict[str, Any]:
    """An OpenAI-SDK harness's usual echo: content, tool calls; reasoning dropped (the SDK's
    message type has no field for it)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls
        ]
    return out


@dataclass
class Scenario:
    name: str
    completion: Callable[[ChatModel], list[int]]
    finish_reason: str = "stop"
    harness: Callable[[dict[str, Any]], dict[str, Any]] = lambda m: m
    tools: bool = True
    next_user: str = "Thanks. And tomorrow?"
    naive_breaks: bool = True
    """Whether a full re-render of what the harness sends changes the sampled tokens."""
    check: Callable[[Any], None] = field(default=lambda message: None)


def _resorted_arguments(m: dict[str, Any]) -> dict[str, Any]:
    m = copy.deepcopy(m)
    for call in m.get("tool_calls") or []:
        call["function"]["arguments"] = json.dumps(
            json.loads(call["function"]["arguments"]), sort_keys=True
        )
    return m


def _python_round_trip_arguments(m: dict[str, Any]) -> dict[str, Any]:
    """Harnesses that keep arguments as dicts and send `str(dict)` back."""
    m = copy.deepcopy(m)
    for call in m.get("tool_calls") or []:
        call["function"]["arguments"] = str(json.loads(call["function"]["arguments"]))
    return m


def _stripped(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "content": (m.get("content") or "").strip()}


def _empty_content(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "content": ""}


def _has_tool_call(name: str) -> Callable[[Any], None]:
    def check(message: Any) -> None:
        assert message.tool_calls and message.tool_calls[0].function.name == name

    return check


def _tool_call(body: str) -> Callable[[ChatModel], list[int]]:
    return lambda m: tokens(m, "<tool_call>", "\n", body, "\n", "</tool_call>", END)


SCENARIOS: list[Scenario] = [
    Scenario(
        "bpe_split",
        lambda m: tokens(m, "Hel", "lo", " there", END),
        tools=False,
    ),
    Scenario(
        "literal_tool_call_in_subwords",
        lambda m: tokens(m, "Wrap calls in ", "<", "tool", "_call", ">", " tags.", END),
        check=lambda message: _is_text_with_tag(message),
    ),
    Scenario(
        "tool_json_compact",
        _tool_call('{"name":"get_weather","arguments":{"city":"Paris"}}'),
        check=_has_tool_call("get_weather"),
    ),
    Scenario(
        "tool_json_unicode_escape",
        _tool_call('{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich"}}'),
        check=_has_tool_call("get_weather"),
    ),
    Scenario(
        "tool_json_number_format",
        _tool_call('{"name": "calc", "arguments": {"x": 1e3, "y": 2}}'),
        check=_has_tool_call("calc"),
    ),
    Scenario(
        "tool_json_key_order_resorted_by_harness",
        _tool_call('{"name": "calc", "arguments": {"y": 1, "x": 2}}'),
        harness=_resorted_arguments,
    ),
    Scenario(
        "tool_arguments_python_round_trip",
        _tool_call('{"name": "calc", "arguments": {"x": false, "y": null}}'),
        harness=_python_round_trip_arguments,
        naive_breaks=False,  # the naive path cannot even parse `{'x': False}`: no prompt at all
    ),
    Scenario(
        "whitespace_before_tool_call",
        lambda m: tokens(
            m,
            "\n\n",
            "<tool_call>",
            "\n",
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
            "\n",
            "</tool_call>",
            END,
        ),
        check=_has_tool_call("get_weather"),
    ),
    Scenario(
        "reasoning_dropped_by_harness_and_template",
        lambda m: tokens(
            m,
            "<think>",
            "\nThe user wants weather.\n",
            "</think>",
            "\n\n",
            "It is sunny.",
            END,
        ),
        tools=False,
    ),
    Scenario(
        "merge_across_prompt_completion_boundary",
        lambda m: tokens(m, "\n\n", "Answer: 42", END),
        harness=_stripped,
        tools=False,
    ),
    Scenario(
        "partial_utf8_character",
        lambda m: tokens(m, "Price: ", b"\xe2\x82", " only", END),
        tools=False,
    ),
    Scenario(
        "truncated_by_max_tokens",
        lambda m: tokens(m, "Hel", "lo", " wor"),
        finish_reason="length",
        tools=False,
    ),
    Scenario(
        "content_empty_string_instead_of_none",
        _tool_call('{"name": "get_weather", "arguments": {"city": "Rome"}}'),
        harness=_empty_content,
        # None and "" render the same; what breaks is the sampled JSON's sub-word split
    ),
    Scenario(
        "whitespace_stripped_by_harness",
        lambda m: tokens(m, "  Sure, here it is.  ", "\n", END),
        harness=_stripped,
        tools=False,
    ),
]


def _is_text_with_tag(message: Any) -> None:
    assert not message.tool_calls, "a <tool_call> spelled in sub-words is text, not a call"
    assert "<tool_call>" in message.content
