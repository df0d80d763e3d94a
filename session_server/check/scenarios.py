"""The check's corpus: the scenarios, and `Scripter`, which spells each scripted completion
in the model's own syntax (from its chat template and vocabulary, non-canonically)."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from session_server.splice import ChatModel

CHECK_MODEL = "tokenkeep-check"
APIS = ("chat", "responses", "messages")
FIRST_USER = "What is the weather in Paris tomorrow?"
PLACEHOLDER = "TKPLACEHOLDERTK"
TOOL = {
    "name": "get_weather",
    "description": "Weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOL_RESULT = '{"temperature": 21, "sky": "clear"}'
CALL_ID = "a1B2c3D4e"  # 9 alphanumerics: what Mistral templates require


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    reply: dict[str, Any]
    """The assistant message the first completion spells, in the template's syntax."""
    tools: bool = False
    finish: str = "stop"
    """`length`: the turn is cut in the middle by max_tokens (no end-of-turn token)."""
    placeholder: str | None = None
    """`marker`: the end-of-turn marker as literal text, spelled byte by byte;
    `partial_utf8`: half a UTF-8 character."""
    harness_strips: bool = False
    quick: bool = False
    """Part of the few scenarios `tokenkeep serve` runs at start-up."""

    @property
    def follow_up_is_tool(self) -> bool:
        return bool(self.reply.get("tool_calls"))


def _call(city: str) -> list[dict[str, Any]]:
    return [
        {
            "id": CALL_ID,
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}},
        }
    ]


SCENARIOS: list[Scenario] = [
    Scenario(
        "bpe_split",
        {"content": "Hello there! Tomorrow looks sunny and warm in Paris."},
        quick=True,
    ),
    Scenario(
        "reasoning",
        {
            "reasoning_content": "The user asks about tomorrow. A short answer is enough.",
            "content": "It will be sunny.",
        },
        quick=True,
    ),
    Scenario(
        "reasoning_then_tool_call",
        {
            "reasoning_content": "I should ask the weather tool.",
            "content": "",
            "tool_calls": _call("Paris"),
        },
        tools=True,
    ),
    Scenario("tool_call", {"content": "", "tool_calls": _call("Zürich")}, tools=True, quick=True),
    Scenario(
        "literal_marker_in_subwords",
        {"content": f"Each turn ends with {PLACEHOLDER} in this format."},
        placeholder="marker",
    ),
    Scenario(
        "partial_utf8_character",
        {"content": f"Price: {PLACEHOLDER} only"},
        placeholder="partial_utf8",
    ),
    Scenario(
        "truncated_by_max_tokens",
        {"content": "Hello there! Tomorrow looks sunny and warm in Paris."},
        finish="length",
    ),
    Scenario(
        "whitespace_stripped_by_harness",
        {"content": "  Sure, here it is.  "},
        harness_strips=True,
    ),
]
FOLLOW_UPS = [
    ("Thanks. And the day after?", "Clear skies again, around 20 degrees."),
    ("One more: summarise.", "Sunny, then clear."),
]


@dataclass(slots=True)
class Completion:
    token_ids: list[int]
    finish_reason: str = "stop"


class Scripter:
    """Completions in the model's own syntax, from its own chat template and vocabulary."""

    def __init__(self, model: ChatModel) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.vocab: dict[str, int] = model.tokenizer.get_vocab()
        added = getattr(model.tokenizer, "added_tokens_decoder", {}) or {}
        self.atomic = sorted(
            {str(getattr(t, "content", t)) for t in added.values()} - {""}, key=len, reverse=True
        )
        self.byte_level = "Ġ" in self.vocab and "<0x0A>" not in self.vocab

    def render_text(
        self, messages: list[dict[str, Any]], tools: bool, *, generation_prompt: bool
    ) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages,
                tools=[{"type": "function", "function": TOOL}] if tools else None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        )

    def completion(self, scenario: Scenario) -> tuple[Completion | None, str | None]:
        """The scripted first completion, or why the scenario does not apply."""
        reply = {"role": "assistant", **scenario.reply}
        body, why = self.assistant_text(reply, scenario.tools)
        if body is None:
            return None, why
        for key in ("reasoning_content",):
            if key in reply and reply[key] not in body:
                return None, "the template does not render reasoning"
        if reply.get("tool_calls") and "get_weather" not in body:
            return None, "the template does not render tool calls"
        substitute: list[int] | None = None
        if scenario.placeholder == "marker":
            marker = self.marker()
            substitute = self.byte_tokens(marker.encode()) if marker else None
            if substitute is None:
                return None, "the end-of-turn marker cannot be spelled in bytes"
        elif scenario.placeholder == "partial_utf8":
            substitute = self.byte_tokens("€".encode()[:2])
            if substitute is None:
                return None, "the vocabulary has no byte tokens"
        tokens = self.spell(body, substitute)
        if scenario.finish == "length":
            return Completion(tokens[: max(1, len(tokens) // 2)], "length"), None
        if tokens and tokens[-1] in self.model.stop_token_ids:
            return Completion(tokens, "stop"), None  # the syntax ends in its own stop (<|call|>)
        return Completion(tokens + self.close(), "stop"), None

    def plain(self, content: str) -> Completion:
        body, _ = self.assistant_text({"role": "assistant", "content": content}, False)
        return Completion(self.spell(body if body is not None else content) + self.close())

    def assistant_text(self, reply: dict[str, Any], tools: bool) -> tuple[str | None, str | None]:
        """What the template writes for an assistant message after its generation prompt,
        up to (not including) the end-of-turn marker."""
        user = [{"role": "user", "content": FIRST_USER}]
        try:
            prompt = self.render_text(user, tools, generation_prompt=True)
            full = self._render_reply(user, reply, tools)
        except Exception as exc:  # templates raise on shapes they do not support
            return None, f"the template refuses it: {one_line(exc)}"
        # Where a template writes a finished turn unlike its generation prompt (a thinking
        # prompt ends in `<think>`, the finished turn holds `</think>` only), the model
        # samples what follows their common part.
        prompt_ids, full_ids = self.model.encode(prompt), self.model.encode(full)
        common = 0
        limit = min(len(prompt_ids), len(full_ids))
        while common < limit and prompt_ids[common] == full_ids[common]:
            common += 1
        body = (
            full[len(prompt) :] if full.startswith(prompt) else self.model.decode(full_ids[common:])
        )
        if (
            reply.get("reasoning_content")
            and not full.startswith(prompt)
            and common < len(prompt_ids)
            and not self.model.opens_reasoning(prompt_ids)
        ):
            # The generation prompt already wrote an empty reasoning block (Gemma 4 31B with
            # thinking off): the model samples no reasoning after it.
            return None, "the generation prompt closes an empty reasoning block"
        think_close = self.model.think_ids[1]
        closer = self.tokenizer.convert_ids_to_tokens(think_close) if think_close else None
        if closer and self.model.opens_reasoning(prompt_ids) and closer not in body:
            # The prompt opened the reasoning block: a model closes it before answering.
            body = f"Let me answer.\n{closer}\n\n{body.lstrip()}"
        marker = self.marker()
        if marker and marker in body:
            body = body[: body.index(marker)]
        return body, None

    def _render_reply(self, user: list[dict[str, Any]], reply: dict[str, Any], tools: bool) -> str:
        """Tool-call arguments as objects (as vLLM's chat endpoint passes them), or as the
        JSON string some templates concatenate."""
        try:
            return self.render_text([*user, reply], tools, generation_prompt=False)
        except Exception:
            if not reply.get("tool_calls"):
                raise
        as_strings = copy.deepcopy(reply)
        for call in as_strings["tool_calls"]:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        return self.render_text([*user, as_strings], tools, generation_prompt=False)

    def marker(self) -> str | None:
        close = self.model.close_token_id
        return None if close is None else self.tokenizer.convert_ids_to_tokens(close)

    def close(self) -> list[int]:
        close = self.model.close_token_id
        if close is not None:
            return [close]
        return self.model.stop_token_ids[:1]

    def spell(self, text: str, substitute: list[int] | None = None) -> list[int]:
        """`text` as a sampler might produce it: added tokens whole, everything else in
        non-canonical sub-word pieces; PLACEHOLDER replaced by `substitute`."""
        names = [PLACEHOLDER, *self.atomic]
        pattern = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")
        out: list[int] = []
        for piece in pattern.split(text):
            if not piece:
                continue
            if piece == PLACEHOLDER:
                out.extend(substitute or [])
            elif piece in self.atomic:
                out.append(self.vocab[piece])
            else:
                out.extend(self.split_pieces(piece))
        return out

    def split_pieces(self, text: str) -> list[int]:
        """The canonical tokens with every other one split into two vocabulary pieces."""
        canonical = self.model.encode(text)
        out: list[int] = []
        for i, token in enumerate(canonical):
            name = self.tokenizer.convert_ids_to_tokens(token)
            halves = self._halves(name) if i % 2 == 0 and name else None
            out.extend(halves or [token])
        if self.model.decode(out) != self.model.decode(canonical):
            return canonical
        return out

    def _halves(self, name: str) -> list[int] | None:
        for cut in range(len(name) // 2, 0, -1):
            left, right = name[:cut], name[cut:]
            if left in self.vocab and right in self.vocab:
                return [self.vocab[left], self.vocab[right]]
        return None

    def byte_tokens(self, data: bytes) -> list[int] | None:
        out: list[int] = []
        table = byte_level_chars() if self.byte_level else {}
        for b in data:
            key = f"<0x{b:02X}>"
            if key not in self.vocab:
                key = table.get(b, "")
            if key not in self.vocab:
                return None
            out.append(self.vocab[key])
        return out


def byte_level_chars() -> dict[int, str]:
    """The byte -> character table of byte-level BPE vocabularies (GPT-2, Qwen, Llama 3)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
