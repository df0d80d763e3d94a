"""`tool_choice` enforced: the vLLM structured-output constraint that makes a reply a call in
the served model's own tool-call syntax (its special tokens as tokens), or a refusal when the
syntax is not one tokenkeep can constrain."""

from __future__ import annotations

import json
import re
from typing import Any

from session_server.conversation import ConversationError, Tool
from session_server.splice import GENERIC, ChatModel, has_tokens, tool_schema
from session_server.toolsyntax import ToolSyntax


def tool_call_syntax(model: ChatModel) -> str | None:
    """How this model writes a tool call: `hermes` (`<tool_call>{json}</tool_call>`, Qwen3
    and the generic parser for templates with those tokens), `llama3-json` (a bare
    `{"name", "parameters"}` object), `learned` (the syntax learned from the template:
    `session_server/toolsyntax.py`), or None where none is known."""
    if model.family == "qwen3" or (
        model.family == GENERIC
        and model.learned_calls is None
        and not model.path.syntax_unlearned
        and has_tokens(model.tokenizer, "<tool_call>", "</tool_call>")
    ):
        return "hermes"
    if model.family == "llama-3":
        return "llama3-json"
    return "learned" if isinstance(model.tool_syntax, ToolSyntax) else None


def tool_choice_constraint(
    model: ChatModel, tools: list[Tool], choice: str | dict[str, Any] | None
) -> dict[str, Any] | None:
    """The vLLM structured-output constraint that makes the sampled tokens a call in the
    model's own tool-call syntax, for `tool_choice` "required" or a named function (None
    for auto/none). A choice that cannot be enforced is refused, never ignored."""
    if choice is None or choice in ("auto", "none"):
        return None
    if not (choice == "required" or isinstance(choice, dict)):
        raise ConversationError(f"unknown tool_choice {choice!r}", param="tool_choice")
    if not tools:
        raise ConversationError("tool_choice requires tools", param="tool_choice")
    named = isinstance(choice, dict)
    chosen = [t for t in tools if t.name == choice["name"]] if named else tools
    if not chosen:
        raise ConversationError(
            f"tool_choice names {choice['name']!r}, which is not among the tools",
            param="tool_choice",
        )
    syntax = tool_call_syntax(model)
    if syntax == "hermes":
        # The markers are matched as the model's own special tokens: spelled in sub-words
        # they would be text to the parser, and the call would not be one.
        vocab = model.tokenizer.get_vocab()
        tags = [
            {
                "type": "tag",
                "begin": {"type": "token", "token": vocab["<tool_call>"]},
                "content": {
                    "type": "sequence",
                    "elements": [
                        {
                            "type": "const_string",
                            "value": f'\n{{"name": {json.dumps(t.name)}, "arguments": ',
                        },
                        # Bounded whitespace runs: pretty-printed arguments fit, but a
                        # sampler cannot stall inside the call until max_tokens.
                        {
                            "type": "json_schema",
                            "json_schema": tool_schema(t),
                            "max_whitespace_cnt": 16,
                        },
                        {"type": "const_string", "value": "}\n"},
                    ],
                },
                "end": {"type": "token", "token": vocab["</tool_call>"]},
            }
            for t in chosen
        ]
        tag_format = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": named,
        }
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": tag_format})}
    if syntax == "llama3-json":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "parameters": tool_schema(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in chosen
        ]
        return {"json": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    learned = model.tool_syntax
    if syntax == "learned" and isinstance(learned, ToolSyntax):
        close = model.think_ids[1]
        tag = learned.constraint(
            [(t.name, tool_schema(t)) for t in chosen],
            lambda text: _literal(model.tokenizer, text),
            None if close is None else str(model.tokenizer.convert_ids_to_tokens(close)),
        )
        if tag is not None:
            return {"structural_tag": json.dumps({"type": "structural_tag", "format": tag})}
    raise ConversationError(
        f"tool_choice {json.dumps(choice)} cannot be enforced: the served model's tool-call "
        f"syntax ({model.family} template) is not one tokenkeep can constrain; use "
        '"auto" or a structured_outputs constraint',
        param="tool_choice",
    )


def _literal(tokenizer: Any, text: str) -> list[dict[str, Any]]:
    """Text as structural-tag elements: the model's special tokens as tokens (spelled in
    sub-words they would be text to the parser), the rest as strings."""
    added = {
        str(getattr(t, "content", t)): int(i)
        for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
    }
    names = sorted((n for n in added if n and n in text), key=len, reverse=True)
    if not names:
        return [{"type": "const_string", "value": text}] if text else []
    out: list[dict[str, Any]] = []
    for piece in re.split("(" + "|".join(re.escape(n) for n in names) + ")", text):
        if piece in added:
            out.append({"type": "token", "token": added[piece]})
        elif piece:
            out.append({"type": "const_string", "value": piece})
    return out
