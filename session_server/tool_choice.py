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
    `{"name", "parameters"}` object), `gemma4` (`<|tool_call>call:name{key:value}<tool_call|>`,
    Gemma 4's own argument syntax), `learned` (the syntax learned from the template:
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
    if model.family == "gemma4":
        return "gemma4"
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
    if syntax == "gemma4":
        return {"structural_tag": json.dumps(_gemma4_calls(model, chosen, named))}
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


def _gemma4_calls(model: ChatModel, chosen: list[Tool], named: bool) -> dict[str, Any]:
    """Calls as Gemma 4's template writes them: `<|tool_call>call:NAME{ARGUMENTS}<tool_call|>`
    (markers as tokens), back to back, the arguments in its own syntax (`GemmaArguments`)."""
    vocab = model.tokenizer.get_vocab()
    begin, end = vocab["<|tool_call>"], vocab["<tool_call|>"]
    quote = vocab[_GEMMA_QUOTE]
    # A string's text may be any tokens but its closing quote and those that end a call or
    # the turn (sampled there, they would cut the call short).
    arguments = GemmaArguments(quote, sorted({quote, begin, end, *model.stop_token_ids}))
    tags = [
        {
            "type": "tag",
            "begin": {"type": "token", "token": begin},
            "content": _sequence([_const(f"call:{t.name}"), arguments.value(tool_schema(t))]),
            "end": {"type": "token", "token": end},
        }
        for t in chosen
    ]
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "",
            "at_least_one": True,
            "stop_after_first": named,
        },
    }


_GEMMA_QUOTE = '<|"|>'
"""Gemma 4's string delimiter, one special token."""
_INTEGER = r"-?(0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(\.[0-9]+)?([eE][-+]?[0-9]+)?"
_KEY = r"[A-Za-z_][A-Za-z0-9_.\-]*"
_ANY_DEPTH = 2
"""How deep a value with no schema may nest (a structural tag cannot recurse)."""


class GemmaArguments:
    """A JSON schema as structural-tag formats of Gemma 4's argument syntax (the template's
    `format_argument` with bare keys): strings between `<|"|>` tokens, keys unquoted in
    case-insensitive sorted order, `true` / `false` / `null`, numbers as written, `{k:v,..}`
    and `[v,..]`, no whitespace. Only declared properties are written (as vLLM's JSON
    schemas are strict)."""

    def __init__(self, quote: int, string_excludes: list[int]) -> None:
        self.quote = {"type": "token", "token": quote}
        self.string_excludes = string_excludes

    def fields(self, schema: dict[str, Any], depth: int) -> list[dict[str, Any]]:
        """An object's `key:value` pairs, comma-separated, the required ones always there."""
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        keys = sorted(properties, key=str.lower)

        def pair(key: str) -> dict[str, Any]:
            return _sequence([_const(f"{key}:"), self.value(properties[key], depth)])

        def after(key: str) -> dict[str, Any]:
            item = _sequence([_const(","), pair(key)])
            return item if key in required else {"type": "optional", "content": item}

        first = next((i for i, key in enumerate(keys) if key in required), None)
        if first is not None:  # optional keys before it carry their comma after them
            before = [
                {"type": "optional", "content": _sequence([pair(key), _const(",")])}
                for key in keys[:first]
            ]
            return [*before, pair(keys[first]), *(after(key) for key in keys[first + 1 :])]
        starts = [
            _sequence([pair(key), *(after(k) for k in keys[i + 1 :])]) for i, key in enumerate(keys)
        ]
        return [{"type": "optional", "content": _choice(starts)}] if starts else []

    def value(self, schema: Any, depth: int = _ANY_DEPTH) -> dict[str, Any]:
        if not isinstance(schema, dict) or not schema:
            return self.any_value(depth)
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return _choice([self.literal(v) for v in schema["enum"]])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return _choice([self.value(s, depth) for s in schema[key]])
        kind = schema.get("type")
        if isinstance(kind, list):
            return _choice([self.value({**schema, "type": k}, depth) for k in kind])
        if kind is None and "properties" in schema:
            kind = "object"
        if kind == "string":
            return self.string()
        if kind == "integer":
            return {"type": "regex", "pattern": _INTEGER}
        if kind == "number":
            return {"type": "regex", "pattern": _NUMBER}
        if kind == "boolean":
            return _choice([_const("true"), _const("false")])
        if kind == "null":
            return _const("null")
        if kind == "object":
            if not schema.get("properties"):
                return self.any_object(depth)
            return _sequence([_const("{"), *self.fields(schema, depth), _const("}")])
        if kind == "array":
            return self.array(self.value(schema.get("items"), max(depth - 1, 0)))
        return self.any_value(depth)

    def string(self) -> dict[str, Any]:
        text = {"type": "any_tokens", "exclude_tokens": self.string_excludes}
        return _sequence([self.quote, text, self.quote])

    def literal(self, value: Any) -> dict[str, Any]:
        if isinstance(value, str):
            return _sequence([self.quote, _const(value), self.quote] if value else [self.quote] * 2)
        if isinstance(value, bool) or value is None:
            return _const({True: "true", False: "false", None: "null"}[value])
        if isinstance(value, list):
            items = [self.literal(v) for v in value]
            commas = [x for item in items for x in (_const(","), item)][1:]
            return _sequence([_const("["), *commas, _const("]")])
        if isinstance(value, dict):
            pairs = [
                _sequence([_const(f"{key}:"), self.literal(value[key])])
                for key in sorted(value, key=str.lower)
            ]
            commas = [x for pair in pairs for x in (_const(","), pair)][1:]
            return _sequence([_const("{"), *commas, _const("}")])
        return _const(str(value))

    def array(self, item: dict[str, Any]) -> dict[str, Any]:
        more = {"type": "star", "content": _sequence([_const(","), item])}
        items = {"type": "optional", "content": _sequence([item, more])}
        return _sequence([_const("["), items, _const("]")])

    def any_object(self, depth: int) -> dict[str, Any]:
        if depth <= 0:
            return _const("{}")
        pair = _sequence(
            [{"type": "regex", "pattern": _KEY}, _const(":"), self.any_value(depth - 1)]
        )
        more = {"type": "star", "content": _sequence([_const(","), pair])}
        pairs = {"type": "optional", "content": _sequence([pair, more])}
        return _sequence([_const("{"), pairs, _const("}")])

    def any_value(self, depth: int) -> dict[str, Any]:
        scalars = [
            self.string(),
            {"type": "regex", "pattern": _NUMBER},
            _const("true"),
            _const("false"),
            _const("null"),
        ]
        if depth <= 0:
            return _choice(scalars)
        return _choice([*scalars, self.any_object(depth), self.array(self.any_value(depth - 1))])


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _choice(options: list[dict[str, Any]]) -> dict[str, Any]:
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}


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
