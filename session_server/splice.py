"""Token-level knowledge of the served model: render, bridge, parse.

`ChatModel` is the one place that turns messages into token IDs and sampled token IDs back
into messages. It uses a hand-written `renderers` renderer where the model family has one
(their `bridge_to_next_turn` appends only the new messages' framing to the exact stored
tokens), and otherwise a generic splice anchored on the template's end-of-turn token.
Either way the result is *proved* before it is used: the new prompt must start with every
stored prompt and sampled token, unchanged. A splice that cannot be proved returns a refusal
reason, never a guessed prompt; the caller starts a new segment and records the reason.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from renderers import (
    DefaultRendererConfig,
    Llama3RendererConfig,
    Qwen3RendererConfig,
    ToolCallParseStatus,
    create_renderer,
)

from session_server.conversation import (
    IMAGE_MARK,
    ConversationError,
    Message,
    Tool,
    ToolCall,
    canonical_text,
)
from session_server.images import PlaceholderRun, expand, vision_spec, vision_tokens

log = logging.getLogger(__name__)

GENERIC = "generic"
BRIDGE_CONTEXT_TOKENS = 512
_OPEN_THINK_WINDOW = 8  # a generation prompt's `<think>` is among its last few tokens
# Renderer families tokenkeep recognises from the tokenizer itself (its special tokens and
# template), because `renderers` only picks a hand-coded renderer on an exact model name.
_FAMILY_CONFIGS: dict[str, Any] = {
    # thinking_retention="all": keep the sampled <think> blocks of earlier turns instead of
    # re-rendering at each new user query; the trajectory must hold what was sampled.
    "qwen3": lambda: Qwen3RendererConfig(thinking_retention="all"),
    "llama-3": lambda: Llama3RendererConfig(),
}


@dataclass(slots=True)
class Bridge:
    """The tokens to append after a stored turn, or why there are none."""

    delta: list[int] | None
    refusal: str | None = None
    runs: list[PlaceholderRun] = field(default_factory=list)
    """The new images' placeholder runs, offsets within `delta`."""


@dataclass(frozen=True, slots=True)
class ReplyEdges:
    """How the renderer's reply parser treats channel edges, probed once per model (the
    streamer must hold back exactly what the parser would strip or reinterpret)."""

    strips_content: bool
    strips_reasoning: bool
    text_think: bool
    """No `<think>` token, yet the parser reads a leading `<think>...</think>` from text."""


@dataclass(slots=True)
class ParsedReply:
    message: Message
    finish_reason: str


class ChatModel:
    """A tokenizer + renderer for one served model."""

    def __init__(self, tokenizer: Any, renderer_name: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.family = detect_family(tokenizer) if renderer_name == "auto" else renderer_name
        if self.family == GENERIC:
            self.renderer = create_renderer(
                tokenizer,
                DefaultRendererConfig(
                    tool_parser="qwen3"
                    if _has_tokens(tokenizer, "<tool_call>", "</tool_call>")
                    else None,
                    reasoning_parser="think"
                    if _has_tokens(tokenizer, "<think>", "</think>")
                    else None,
                ),
            )
        elif self.family in _FAMILY_CONFIGS:
            self.renderer = create_renderer(tokenizer, _FAMILY_CONFIGS[self.family]())
        else:
            from renderers import config_from_name

            config = config_from_name(self.family)
            if config is not None and "thinking_retention" in type(config).model_fields:
                # As for Qwen3: sampled reasoning stays in later prompts (no re-render).
                config = config.model_copy(update={"thinking_retention": "all"})
            self.renderer = create_renderer(tokenizer, config)
        stop_ids = list(self.renderer.get_stop_token_ids())
        self._renderer_stops = frozenset(stop_ids)
        for extra in _generation_config_eos(tokenizer):
            if extra not in stop_ids:
                stop_ids.append(extra)
        self.close_token_id: int | None = detect_close_token(tokenizer) or (
            stop_ids[0] if stop_ids else None
        )
        if self.close_token_id is not None and self.close_token_id not in stop_ids:
            # The token a template puts after an assistant message is where a turn ends,
            # whatever the tokenizer calls its EOS (Llama 3: <|eot_id|>, not <|end_of_text|>).
            stop_ids.append(self.close_token_id)
        self.stop_token_ids: list[int] = stop_ids
        self.vocab_size = len(tokenizer)
        vocab = tokenizer.get_vocab()
        self.think_ids: tuple[int | None, int | None] = (
            vocab.get("<think>"),
            vocab.get("</think>"),
        )
        # A vision-language model: its processor settings decide each image's placeholders.
        model_path = str(getattr(tokenizer, "name_or_path", "") or "")
        self.vision = vision_tokens(vision_spec(model_path), vocab) if model_path else None

    def _expand(
        self, ids: list[int], messages: list[Message]
    ) -> tuple[list[int], list[PlaceholderRun]]:
        images = [image for m in messages for image in m.images]
        if not images:
            return ids, []
        if self.vision is None:
            raise ConversationError(
                "the served model takes no images (text-only)", param="messages"
            )
        try:
            return expand(ids, images, self.vision)
        except ValueError as exc:  # a template that does not write Qwen-VL placeholders
            raise ConversationError(f"images cannot be placed: {exc}", param="messages") from exc

    def opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends inside a reasoning block the template opened (QwQ,
        DeepSeek-R1 and GLM generation prompts end in `<think>`)."""
        start, end = self.think_ids
        if start is None:
            return False
        for token in reversed(prompt_ids[-_OPEN_THINK_WINDOW:]):
            if token == end:
                return False
            if token == start:
                return True
        return False

    # --- rendering --------------------------------------------------------------------

    def render_prompt(self, messages: list[Message], tools: list[Tool]) -> list[int]:
        """A whole prompt, ending where the next assistant turn starts generating."""
        return self.render_prompt_runs(messages, tools)[0]

    def render_prompt_runs(
        self, messages: list[Message], tools: list[Tool]
    ) -> tuple[list[int], list[PlaceholderRun]]:
        """`render_prompt` and where its images' placeholder runs are."""
        if self.family == GENERIC:
            ids = self._apply_template(messages, tools, add_generation_prompt=True)
        else:
            ids = list(
                self.renderer.render_ids(
                    to_renderer_messages(messages),
                    tools=to_renderer_tools(tools),
                    add_generation_prompt=True,
                )
            )
        return self._expand(ids, messages)

    def _apply_template(
        self, messages: list[Message], tools: list[Tool], *, add_generation_prompt: bool
    ) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            to_renderer_messages(messages, arguments_as_dict=True),
            tools=[t.as_openai() for t in tools] or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return list(out)

    def bridge(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        finish_reason: str,
        history: list[Message],
        new_messages: list[Message],
        tools: list[Tool],
    ) -> Bridge:
        """Tokens that follow `prompt_ids + completion_ids` for `new_messages`.

        `history` is the request's messages up to and including the stored turn's reply,
        as the harness sent them (only the generic splice reads it)."""
        if not new_messages:
            return Bridge(None, "no_new_messages")
        if any(m.role == "assistant" for m in new_messages):
            return Bridge(None, "assistant_message_not_sampled")
        if self.family == GENERIC:
            delta = self._generic_bridge(
                prompt_ids, completion_ids, finish_reason, history, new_messages, tools
            )
        else:
            # The family bridges read only the end of the prompt (is a reasoning block still
            # open?) and copy and return whatever they are given: callers may pass just the
            # last BRIDGE_CONTEXT_TOKENS, which keeps the per-turn cost flat in the history.
            tail = prompt_ids[-BRIDGE_CONTEXT_TOKENS:]
            rendered = self.renderer.bridge_to_next_turn(
                tail,
                completion_ids,
                to_renderer_messages(new_messages),
                tools=to_renderer_tools(tools),
            )
            delta = None if rendered is None else _prove(tail, completion_ids, rendered)
        if delta is None:
            return Bridge(None, "bridge_unproven")
        expanded, runs = self._expand(delta, new_messages)
        return Bridge(expanded, runs=runs)

    def _generic_bridge(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        finish_reason: str,
        history: list[Message],
        new_messages: list[Message],
        tools: list[Tool],
    ) -> list[int] | None:
        """End-of-turn anchored splice: the template's tokens after the stored turn's close.

        Counting close tokens (rather than comparing positions) survives templates that
        rewrite earlier turns, e.g. dropping their reasoning."""
        close = self.close_token_id
        if close is None:
            return None
        closing: list[int] = []
        if not completion_ids or completion_ids[-1] not in self.stop_token_ids:
            if finish_reason != "length" and completion_ids:
                return None
            closing = [close]  # a truncated turn is closed as context, never as loss
        before = self._apply_template(history, tools, add_generation_prompt=False)
        after = self._apply_template(history + new_messages, tools, add_generation_prompt=True)
        turns_closed = before.count(close)
        if not _closed_at_end(self.tokenizer, before, close):
            turns_closed += 1  # the template closes a turn by opening the next one (GLM)
        position = _nth_index(after, close, turns_closed)
        if turns_closed == 0 or position is None:
            return None
        delta = closing + after[position + 1 :]
        if not _carries_messages(self.tokenizer, delta, new_messages):
            return None
        return delta

    # --- parsing ----------------------------------------------------------------------

    @functools.cached_property
    def reply_edges(self) -> ReplyEdges:
        probe = "tokenkeep probe"
        vocab = self.tokenizer.get_vocab()
        atomic_think = "<think>" in vocab and "</think>" in vocab
        if atomic_think:
            think = [vocab["<think>"], *self.encode(f"\n{probe}\n"), vocab["</think>"]]
        else:
            think = self.encode(f"<think>\n{probe}\n</think>")
        close = [self.close_token_id] if self.close_token_id is not None else []
        content = self._parse_ids([*self.encode(f"\n\n{probe}"), *close], [], [])
        reasoning = self._parse_ids([*think, *self.encode("x"), *close], [], []).reasoning_content
        return ReplyEdges(
            strips_content=content.content == probe,
            strips_reasoning=reasoning == probe,
            text_think=not atomic_think and bool(reasoning),
        )

    def _parse_ids(
        self, completion_ids: list[int], prompt_ids: list[int], tools: list[Tool]
    ) -> Any:
        ids = list(completion_ids)
        if ids and ids[-1] in self.stop_token_ids and ids[-1] not in self._renderer_stops:
            # An end-of-turn token the renderer does not know (generic Llama 3, GLM's
            # <|user|>) must not stay in the text.
            ids.pop()
        if self.family == GENERIC and self.opens_reasoning(prompt_ids):
            # The default renderer finds a prompt-opened `<think>` only after a ChatML
            # header; other templates (GLM) open it too: parse as if it were sampled.
            ids = [self.think_ids[0], *ids]
        return self.renderer.parse_response(
            ids, tools=to_renderer_tools(tools), prompt_ids=prompt_ids
        )

    def parse(
        self,
        completion_ids: list[int],
        finish_reason: str,
        prompt_ids: list[int],
        tools: list[Tool],
    ) -> ParsedReply:
        """The sampled tokens as an assistant message (parsed from token IDs, in-process)."""
        parsed = self._parse_ids(completion_ids, prompt_ids, tools)
        reasoning = parsed.reasoning_content
        if reasoning and parsed.reasoning_complete is False and self.reply_edges.strips_reasoning:
            reasoning = reasoning.strip()  # as the parser shows a closed block
        calls = [
            ToolCall(
                id=tc.id or "call_" + uuid.uuid4().hex[:24],
                name=tc.name or "",
                arguments=sampled_arguments(tc.raw, tc.arguments),
            )
            for tc in parsed.tool_calls
            if tc.status == ToolCallParseStatus.OK and tc.name
        ]
        message = Message(
            role="assistant",
            content=parsed.content or "",
            reasoning=reasoning or None,
            tool_calls=calls,
        )
        if finish_reason == "stop" and calls:
            finish_reason = "tool_calls"
        return ParsedReply(message=message, finish_reason=finish_reason)

    # --- constrained tool calls -------------------------------------------------------

    @property
    def tool_call_syntax(self) -> str | None:
        """How this model writes a tool call: `hermes` (`<tool_call>{json}</tool_call>`, Qwen3
        and the generic parser for templates with those tokens), `llama3-json` (a bare
        `{"name", "parameters"}` object), or None where tokenkeep does not know it."""
        if self.family == "qwen3" or (
            self.family == GENERIC and _has_tokens(self.tokenizer, "<tool_call>", "</tool_call>")
        ):
            return "hermes"
        if self.family == "llama-3":
            return "llama3-json"
        return None

    def tool_choice_constraint(
        self, tools: list[Tool], choice: str | dict[str, Any] | None
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
        syntax = self.tool_call_syntax
        if syntax == "hermes":
            # The markers are matched as the model's own special tokens: spelled in sub-words
            # they would be text to the parser, and the call would not be one.
            vocab = self.tokenizer.get_vocab()
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
                                "json_schema": _schema(t),
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
                    "properties": {"name": {"const": t.name}, "parameters": _schema(t)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in chosen
            ]
            return {"json": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        raise ConversationError(
            f"tool_choice {json.dumps(choice)} cannot be enforced: the served model's tool-call "
            f"syntax ({self.family} template) is not one tokenkeep can constrain; use "
            '"auto" or a structured_outputs constraint',
            param="tool_choice",
        )

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


# --- helpers ------------------------------------------------------------------------------

_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def sampled_arguments(raw: str, parsed: Any) -> str:
    """The arguments exactly as the model wrote them (compact JSON stays compact, escapes
    stay escaped), when they can be cut out of the raw tool-call block; else re-serialised."""
    if isinstance(parsed, str):
        return parsed
    decoder = json.JSONDecoder()
    for match in _ARGUMENTS_KEY.finditer(raw):
        try:
            value, end = decoder.raw_decode(raw, match.end())
        except ValueError:
            continue
        if value == parsed:
            return raw[match.end() : end]
    return json.dumps(parsed, ensure_ascii=False)


def _schema(tool: Tool) -> dict[str, Any]:
    return tool.parameters or {"type": "object"}


def _prove(prompt_ids: list[int], completion_ids: list[int], rendered: Any) -> list[int] | None:
    """The bridge's new tokens, if it kept every stored token in place; else None."""
    tokens = rendered.token_ids
    cut = len(prompt_ids) + len(completion_ids)
    if len(tokens) < cut or tokens[: len(prompt_ids)] != prompt_ids:
        return None
    if tokens[len(prompt_ids) : cut] != completion_ids:
        return None
    return list(tokens[cut:])


def _nth_index(tokens: list[int], token: int, n: int) -> int | None:
    seen = 0
    for i, t in enumerate(tokens):
        if t == token:
            seen += 1
            if seen == n:
                return i
    return None


def _closed_at_end(tokenizer: Any, tokens: list[int], close: int) -> bool:
    """Whether a rendered history ends with its last turn's close token (then only
    whitespace), or leaves the close to the next message."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == close:
            return not tokenizer.decode(tokens[i + 1 :]).strip()
    return False


def _carries_messages(tokenizer: Any, delta: list[int], messages: list[Message]) -> bool:
    """Proof for the generic splice: each new message's text appears in the bridge, in order."""
    text = tokenizer.decode(delta, skip_special_tokens=False)
    position = 0
    for message in messages:
        # Around an image the template writes its placeholder, not the mark.
        for piece in canonical_text(message.content).split(IMAGE_MARK):
            needle = piece.strip()
            if not needle:
                continue
            found = text.find(needle, position)
            if found < 0:
                return False
            position = found + len(needle)
    return True


def _has_tokens(tokenizer: Any, *tokens: str) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in tokens)


def detect_family(tokenizer: Any) -> str:
    """Which hand-written renderer fits this tokenizer, from its own special tokens and
    chat template; `generic` when none does."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if (
        _has_tokens(tokenizer, "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>")
        and "<tool_call>" in template
        and ("enable_thinking" in template or "reasoning_content" in template)
    ):
        return "qwen3"
    if _has_tokens(tokenizer, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>") and (
        "<|start_header_id|>" in template
    ):
        return "llama-3"
    return GENERIC


def detect_close_token(tokenizer: Any) -> int | None:
    """The special token the chat template puts right after an assistant message: its own
    end-of-turn token (ChatML <|im_end|>, Llama 3 <|eot_id|>) or, in templates that close a
    turn by opening the next one (GLM: <|user|>), the next message's role token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "tokenkeepprobe"
    special = set(tokenizer.all_special_ids) | set(
        getattr(tokenizer, "added_tokens_decoder", {}) or {}
    )
    exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    for messages in (exchange, [*exchange, {"role": "user", "content": "hi"}]):
        try:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        except Exception:  # templates raise on shapes they dislike; then there is no anchor
            return None
        found = _special_after(tokenizer, list(ids), marker, special)
        if found is not None:
            return found
    return None


def _special_after(tokenizer: Any, ids: list[int], marker: str, special: set[int]) -> int | None:
    decoded = ""
    for i, token in enumerate(ids):
        decoded += tokenizer.decode([token])
        if marker in decoded:
            for following in ids[i + 1 :]:
                if following in special:
                    return int(following)
            return None
    return None


def _generation_config_eos(tokenizer: Any) -> list[int]:
    path = Path(str(getattr(tokenizer, "name_or_path", ""))) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def to_renderer_tools(tools: list[Tool]) -> list[dict[str, Any]] | None:
    """Tools in the OpenAI shape the model's own chat template renders (Qwen3's `<tools>`
    block shows `{"type": "function", "function": {...}}`, as vLLM's chat endpoint does)."""
    return [t.as_openai() for t in tools] or None


def to_renderer_messages(
    messages: list[Message], *, arguments_as_dict: bool = False
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": _content(m)}
        if m.role == "assistant" and m.reasoning:
            entry["reasoning_content"] = m.reasoning
        if m.tool_calls:
            entry["tool_calls"] = [
                {
                    "type": "function",
                    "id": call.id,
                    "function": {
                        "name": call.name,
                        "arguments": _arguments_value(call.arguments)
                        if arguments_as_dict
                        else call.arguments,
                    },
                }
                for call in m.tool_calls
            ]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def _content(message: Message) -> str | list[dict[str, str]]:
    """Text, or for a message with images the content-part list VL chat templates render
    (an image part where each `IMAGE_MARK` is)."""
    if not message.images:
        return message.content or ""
    parts: list[dict[str, str]] = []
    for i, piece in enumerate(message.content.split(IMAGE_MARK)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
