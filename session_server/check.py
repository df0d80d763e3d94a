"""`tokenkeep check`: will this model's rollouts stay token-exact through tokenkeep?

The check loads the tokenizer and chat template as `tokenkeep serve` does, then drives a
corpus of multi-turn scenarios through the real serving path in-process: the ASGI app (each
API, streamed and not) -> TurnService -> splice, in front of `ScriptedEngine`, an in-process
implementation of the engine-client interface that "samples" scripted completions.

The completions come from the model's own chat template: an assistant message (text,
reasoning, a tool call) is rendered by the template, the text after the generation prompt is
cut at the end-of-turn token and tokenized *non-canonically* (canonical tokens split into
sub-word pieces that are in the vocabulary, literal markers spelled byte by byte, a UTF-8
character cut in half, a turn cut by max_tokens). So every family gets completions in its own
syntax, and the kind a real sampler produces but a re-tokenizer never gives back.

Per scenario it compares what the engine received on each later turn with what was stored
(prompt + sampled tokens) before: tokenkeep keeps them contiguous or records why not. It does
the same for a naive server that re-renders the whole history with the template each turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import re
import secrets
import sys
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx

from session_server import __version__
from session_server.engines import EngineChoice, Generation, GenerationDelta, StreamStart
from session_server.images import ImageInput
from session_server.settings import Settings
from session_server.splice import GENERIC, ChatModel

log = logging.getLogger("tokenkeep.check")

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


class CheckInputError(Exception):
    """The tokenizer folder cannot be checked (exit 2, one line)."""


# --- the corpus -------------------------------------------------------------------------------


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
            return None, f"the template refuses it: {_one_line(exc)}"
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


# --- the in-process engine --------------------------------------------------------------------


class ScriptedEngine:
    """The engine-client interface of `session_server.engines.EngineClient`, in-process:
    each generation "samples" the next queued completion. Not a vLLM double: nothing here
    speaks HTTP; the check needs the serving path above the engine, not the wire."""

    url = "in-process"
    replicas: tuple[Any, ...] = ()  # no replica to report in a session's engine versions

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self._queue: deque[Completion] = deque()

    def script(self, *completions: Completion) -> None:
        self._queue.extend(completions)

    def reset(self) -> None:
        self.prompts.clear()
        self._queue.clear()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ready(self) -> bool:
        return True

    def _next(self, prompt_ids: list[int]) -> Completion:
        self.prompts.append(list(prompt_ids))
        return self._queue.popleft()

    async def generate(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        *,
        reasoning_ended: bool | None = None,
        images: tuple[ImageInput, ...] = (),
        prompt_json: bytes | None = None,
    ) -> Generation:
        # `images`: the check's scenarios carry none (the engine would expand them).
        c = self._next(prompt_ids)
        choice = EngineChoice(
            0, list(c.token_ids), [-0.1] * len(c.token_ids), c.finish_reason, None
        )
        return Generation(list(prompt_ids), [choice], self.url, 0.0)

    async def stream(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        *,
        reasoning_ended: bool | None = None,
        images: tuple[ImageInput, ...] = (),
        prompt_json: bytes | None = None,
    ) -> AsyncIterator[StreamStart | GenerationDelta]:
        c = self._next(prompt_ids)
        yield StreamStart(self.url, list(prompt_ids))
        last = len(c.token_ids) - 1
        for i, token in enumerate(c.token_ids):
            yield GenerationDelta(0, [token], [-0.1], c.finish_reason if i == last else None, None)


# --- the harnesses: one per API, each echoing replies the way its SDK users do ----------------


@dataclass(slots=True)
class Echo:
    """A reply as the harness keeps it: its API's own shape and the chat-message form."""

    chat: dict[str, Any]
    call_ids: list[str]


class Harness:
    api = ""
    path = ""

    def __init__(self, tools: bool, strip: bool) -> None:
        self.tools = tools
        self.strip = strip
        self.history: list[Any] = []

    def add_user(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})

    def add_tool_result(self, call_id: str, text: str) -> None:
        raise NotImplementedError

    def body(self, stream: bool) -> dict[str, Any]:
        raise NotImplementedError

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        raise NotImplementedError

    def _content(self, text: str | None) -> str:
        text = text or ""
        return text.strip() if self.strip else text


class ChatHarness(Harness):
    """OpenAI SDK habit: content and tool calls echoed; reasoning dropped (no field for it)."""

    api = "chat"
    path = "/v1/chat/completions"

    def add_tool_result(self, call_id: str, text: str) -> None:
        self.history.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": CHECK_MODEL, "messages": self.history, "stream": stream}
        if self.tools:
            body["tools"] = [{"type": "function", "function": TOOL}]
        return body

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        if stream:
            content, calls = "", {}
            for event in _sse(response.text):
                delta = (event.get("choices") or [{}])[0].get("delta") or {}
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                    entry["id"] = call.get("id") or entry["id"]
                    function = call.get("function") or {}
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for _, c in sorted(calls.items())
            ]
        else:
            message = response.json()["choices"][0]["message"]
            content = message.get("content") or ""
            tool_calls = [
                {"id": c["id"], "type": "function", "function": dict(c["function"])}
                for c in message.get("tool_calls") or []
            ]
        echo: dict[str, Any] = {"role": "assistant", "content": self._content(content)}
        if tool_calls:
            echo["tool_calls"] = tool_calls
        self.history.append(echo)
        return Echo(echo, [c["id"] for c in tool_calls])


class ResponsesHarness(Harness):
    """Responses SDK habit: the output items (reasoning included) go back as input."""

    api = "responses"
    path = "/v1/responses"

    def add_tool_result(self, call_id: str, text: str) -> None:
        self.history.append({"type": "function_call_output", "call_id": call_id, "output": text})

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": CHECK_MODEL, "input": self.history, "stream": stream}
        if self.tools:
            body["tools"] = [{"type": "function", **TOOL}]
        return body

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        if stream:
            output = next(
                e["response"]["output"]
                for e in _sse(response.text)
                if e.get("type") in _RESPONSE_DONE
            )
        else:
            output = response.json()["output"]
        chat: dict[str, Any] = {"role": "assistant", "content": ""}
        calls: list[dict[str, Any]] = []
        for item in output:
            if item["type"] == "reasoning":
                chat["reasoning_content"] = "".join(p["text"] for p in item.get("content") or [])
            elif item["type"] == "message":
                for part in item["content"]:
                    part["text"] = self._content(part.get("text"))
                chat["content"] = "".join(p["text"] for p in item["content"])
            elif item["type"] == "function_call":
                calls.append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
            self.history.append(item)
        if calls:
            chat["tool_calls"] = calls
        return Echo(chat, [c["id"] for c in calls])


class MessagesHarness(Harness):
    """Anthropic SDK habit: the content blocks (thinking with its signature) go back."""

    api = "messages"
    path = "/v1/messages"

    def add_tool_result(self, call_id: str, text: str) -> None:
        block = {"type": "tool_result", "tool_use_id": call_id, "content": text}
        self.history.append({"role": "user", "content": [block]})

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": CHECK_MODEL,
            "max_tokens": 1024,
            "messages": self.history,
            "stream": stream,
        }
        if self.tools:
            body["tools"] = [
                {
                    "name": TOOL["name"],
                    "description": TOOL["description"],
                    "input_schema": TOOL["parameters"],
                }
            ]
        return body

    def reply(self, response: httpx.Response, stream: bool) -> Echo:
        blocks = _message_blocks(response.text) if stream else response.json()["content"]
        chat: dict[str, Any] = {"role": "assistant", "content": ""}
        calls: list[dict[str, Any]] = []
        for block in blocks:
            if block["type"] == "thinking":
                chat["reasoning_content"] = block["thinking"]
            elif block["type"] == "text":
                block["text"] = self._content(block["text"])
                chat["content"] += block["text"]
            elif block["type"] == "tool_use":
                arguments = json.dumps(block["input"], ensure_ascii=False)
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": arguments},
                    }
                )
        self.history.append({"role": "assistant", "content": blocks})
        if calls:
            chat["tool_calls"] = calls
        return Echo(chat, [c["id"] for c in calls])


_RESPONSE_DONE = ("response.completed", "response.incomplete")
HARNESSES: dict[str, type[Harness]] = {
    h.api: h for h in (ChatHarness, ResponsesHarness, MessagesHarness)
}


def _sse(text: str) -> Iterable[dict[str, Any]]:
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def _message_blocks(text: str) -> list[dict[str, Any]]:
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    for event in _sse(text):
        kind = event.get("type")
        if kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
    for index, raw in partial.items():
        blocks[index]["input"] = json.loads(raw) if raw else {}
    return [blocks[i] for i in sorted(blocks)]


# --- running ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    name: str
    api: str
    stream: bool
    naive_contiguous: bool
    contiguous: bool
    reason: str | None
    naive_reason: str | None = None
    tokenkeep_reason: str | None = None
    calls_parsed: bool | None = None
    """A scripted tool call came back as a call (None: the scenario has none)."""
    stream_equal: bool | None = None
    """The streamed reply assembled equals the non-streamed one (None: not compared)."""
    first_reply: dict[str, Any] | None = None


@dataclass(slots=True)
class Report:
    model: str
    renderer: str
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    path_reason: str = ""

    @property
    def contiguous(self) -> bool:
        """Every run kept token-exact (no run at all is no verdict: not contiguous)."""
        return bool(self.rows) and all(r.contiguous for r in self.rows)

    @property
    def tool_calls_parsed(self) -> bool | None:
        """Every scripted tool call came back as a call (None: no tool-call run)."""
        verdicts = [r.calls_parsed for r in self.rows if r.calls_parsed is not None]
        return all(verdicts) if verdicts else None

    @property
    def stream_equal(self) -> bool | None:
        """Every streamed reply equals its non-streamed twin (None: none compared)."""
        verdicts = [r.stream_equal for r in self.rows if r.stream_equal is not None]
        return all(verdicts) if verdicts else None

    @property
    def ok(self) -> bool:
        """Token-exact, tool calls parsed as calls, streamed = non-streamed."""
        return (
            self.contiguous
            and self.tool_calls_parsed is not False
            and (self.stream_equal is not False)
        )

    def as_json(self) -> dict[str, Any]:
        keys = (
            "name",
            "api",
            "stream",
            "naive_contiguous",
            "contiguous",
            "calls_parsed",
            "stream_equal",
            "reason",
        )
        return {
            "model": self.model,
            "renderer": self.renderer,
            "path_reason": self.path_reason,
            "contiguous": self.contiguous,
            "tool_calls_parsed": self.tool_calls_parsed,
            "stream_equal": self.stream_equal,
            "ok": self.ok,
            "scenarios": [{k: asdict(r)[k] for k in keys} for r in self.rows],
        }


def load_model(tokenizer_dir: str, renderer: str = "auto") -> ChatModel:
    """The tokenizer and template as `tokenkeep serve` loads them; CheckInputError if the
    folder cannot serve chat at all."""
    from session_server.tokenizer import load_tokenizer

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise CheckInputError(f"{tokenizer_dir}: not a directory")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckInputError(f"{tokenizer_dir}: no tokenizer here (no tokenizer.json)")
    try:
        tokenizer = load_tokenizer(str(path))
    except Exception as exc:  # whatever transformers raises on a broken folder
        raise CheckInputError(
            f"{tokenizer_dir}: cannot load the tokenizer: {_one_line(exc)}"
        ) from exc
    if not tokenizer.chat_template:
        raise CheckInputError(f"{tokenizer_dir}: the tokenizer has no chat template")
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": FIRST_USER}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    except Exception as exc:  # a template's own raise_exception(), or a Jinja error
        raise CheckInputError(
            f"{tokenizer_dir}: the chat template fails: {_one_line(exc)}"
        ) from exc
    try:
        return ChatModel(tokenizer, renderer)
    except Exception as exc:
        raise CheckInputError(f"renderer {renderer!r}: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


async def run_check(
    model: ChatModel,
    *,
    name: str = "",
    scenarios: list[Scenario] | None = None,
    apis: Iterable[str] = APIS,
    streams: Iterable[bool] = (False, True),
    progress: Callable[[str], None] | None = None,
) -> Report:
    from session_server.app import build_service, create_app
    from session_server.engines import EngineClient
    from session_server.store.memory import MemoryStore

    report = Report(
        model=name or str(model.tokenizer.name_or_path),
        renderer=model.family,
        path_reason=model.path.reason,
    )
    engine = ScriptedEngine()
    # The in-process app is the check's own: whatever TOKENKEEP_ADMIN_KEY the environment sets
    # (the operator always sets one), it gets a key of its own and every request presents it,
    # so the check goes through the auth layer as a deployed server's clients do.
    admin_key = secrets.token_urlsafe(24)
    settings = Settings(model=CHECK_MODEL, tokenizer="", renderer=model.family, admin_key=admin_key)
    service = build_service(
        settings,
        store=MemoryStore(),
        model=model,
        # ScriptedEngine implements EngineClient's interface, in-process.
        engine=cast(EngineClient, engine),
    )
    app = create_app(settings, service)
    scripter = Scripter(model)
    follow_ups = [(user, scripter.plain(reply)) for user, reply in FOLLOW_UPS]
    planned: list[tuple[Scenario, Completion]] = []
    for scenario in scenarios if scenarios is not None else SCENARIOS:
        completion, why = scripter.completion(scenario)
        if completion is None:
            report.skipped[scenario.name] = why or "not applicable"
        else:
            planned.append((scenario, completion))
    runs = [(s, c, api, stream) for s, c in planned for api in apis for stream in streams]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://check",
        headers={"Authorization": f"Bearer {admin_key}"},
        timeout=60,
    ) as client:
        for done, (scenario, completion, api, stream) in enumerate(runs):
            if progress:
                progress(
                    f"[{done + 1}/{len(runs)}] {scenario.name} {api}{' stream' if stream else ''}"
                )
            engine.reset()
            report.rows.append(
                await _run_one(
                    client, engine, scripter, scenario, completion, follow_ups, api, stream
                )
            )
    _compare_streams(report.rows)
    return report


def _compare_streams(rows: list[Row]) -> None:
    """Marks each streamed run whose first reply differs from the non-streamed run's."""
    plain = {(r.name, r.api): r.first_reply for r in rows if not r.stream}
    for row in rows:
        twin = plain.get((row.name, row.api))
        if not row.stream or twin is None or row.first_reply is None:
            continue
        row.stream_equal = row.first_reply == twin
        if not row.stream_equal:
            row.reason = "; ".join(
                filter(None, [f"streamed {row.first_reply} != non-streamed {twin}", row.reason])
            )


async def _run_one(
    client: httpx.AsyncClient,
    engine: ScriptedEngine,
    scripter: Scripter,
    scenario: Scenario,
    first: Completion,
    follow_ups: list[tuple[str, Completion]],
    api: str,
    stream: bool,
) -> Row:
    model = scripter.model
    session = f"check-{uuid.uuid4().hex[:16]}"
    harness = HARNESSES[api](scenario.tools, scenario.harness_strips)
    harness.add_user(FIRST_USER)
    chat: list[dict[str, Any]] = [{"role": "user", "content": FIRST_USER}]
    completions = [first, *(c for _, c in follow_ups)]
    engine.script(*completions)
    naive_prev: list[int] | None = None
    naive_reason: str | None = None
    failure: str | None = None
    calls_parsed: bool | None = None
    first_reply: dict[str, Any] | None = None
    for turn, completion in enumerate(completions):
        try:
            naive = _naive_prompt(scripter, chat, scenario.tools)
        except Exception as exc:  # the template rejects the history as the harness sent it
            naive_reason = naive_reason or f"turn {turn + 1}: re-rendering fails: {_one_line(exc)}"
            naive = []
        if naive_prev is not None and naive_reason is None:
            naive_reason = _first_difference(model, naive_prev, naive, turn)
        response = await client.post(
            f"/sessions/{session}{harness.path}", json=harness.body(stream)
        )
        if response.status_code != 200:
            answer = response.text[:200]
            failure = f"turn {turn + 1}: the {api} API answered {response.status_code}: {answer}"
            break
        try:
            echo = harness.reply(response, stream)
        except (KeyError, ValueError, StopIteration) as exc:
            failure = f"turn {turn + 1}: unreadable {api} reply: {_one_line(exc)}"
            break
        chat.append(echo.chat)
        if turn == 0:
            first_reply = _comparable(echo.chat)
            if scenario.reply.get("tool_calls"):
                calls_parsed = _same_calls(echo.chat, scenario.reply)
        naive_prev = naive + completion.token_ids
        if turn + 1 == len(completions):
            break
        user, _ = follow_ups[turn]
        if turn == 0 and scenario.follow_up_is_tool and echo.call_ids:
            harness.add_tool_result(echo.call_ids[0], TOOL_RESULT)
            chat.append({"role": "tool", "tool_call_id": echo.call_ids[0], "content": TOOL_RESULT})
        else:
            harness.add_user(user)
            chat.append({"role": "user", "content": user})
    tokenkeep_reason = failure
    if failure is None:
        for turn in range(1, len(engine.prompts)):
            stored = engine.prompts[turn - 1] + completions[turn - 1].token_ids
            difference = _first_difference(model, stored, engine.prompts[turn], turn)
            if difference is not None:
                breaks = (await client.get(f"/sessions/{session}")).json().get("breaks") or {}
                recorded = ", ".join(sorted(breaks)) or "none"
                tokenkeep_reason = f"new segment (recorded: {recorded}); {difference}"
                break
    reasons = [f"tokenkeep: {tokenkeep_reason}" if tokenkeep_reason else None]
    reasons.append(f"naive: {naive_reason}" if naive_reason else None)
    if calls_parsed is False:
        reasons.insert(0, f"tool call not parsed: the harness got {first_reply}")
    return Row(
        name=scenario.name,
        api=api,
        stream=stream,
        naive_contiguous=naive_reason is None,
        contiguous=tokenkeep_reason is None,
        reason="; ".join(r for r in reasons if r) or None,
        naive_reason=naive_reason,
        tokenkeep_reason=tokenkeep_reason,
        calls_parsed=calls_parsed,
        first_reply=first_reply,
    )


def _comparable(chat: dict[str, Any]) -> dict[str, Any]:
    """A reply as the harness kept it, without the per-request call ids."""
    out = {k: v for k, v in chat.items() if k != "tool_calls"}
    out["calls"] = [
        (c["function"]["name"], _json_or_text(c["function"]["arguments"]))
        for c in chat.get("tool_calls") or []
    ]
    return out


def _same_calls(chat: dict[str, Any], scripted: dict[str, Any]) -> bool:
    """The harness got the scripted calls as calls (names and arguments)."""
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in scripted["tool_calls"]]
    return _comparable(chat)["calls"] == expected


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _naive_prompt(scripter: Scripter, chat: list[dict[str, Any]], tools: bool) -> list[int]:
    """What a server without tokenkeep sends: the template over the whole history as the
    harness sent it (tool-call arguments parsed back into objects, as vLLM's chat endpoint
    does)."""
    messages = copy.deepcopy(chat)
    for m in messages:
        for call in m.get("tool_calls") or []:
            with contextlib.suppress(TypeError, ValueError):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = scripter.render_text(messages, tools, generation_prompt=True)
    return scripter.model.encode(text)


def _first_difference(
    model: ChatModel, stored: list[int], prompt: list[int], turn: int
) -> str | None:
    """None if `prompt` starts with every stored token; else where and how it differs."""
    if prompt[: len(stored)] == stored:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(stored, prompt, strict=False)) if a != b),
        min(len(stored), len(prompt)),
    )
    kept = model.decode(stored[at:])
    got = model.decode(prompt[at:])
    how = "same text, different tokens" if got.startswith(kept) else "text changed"
    return (
        f"turn {turn + 1} differs at token {at} ({how}): "
        f"stored {_excerpt(model.decode(stored[at : at + 6]))} "
        f"vs {_excerpt(model.decode(prompt[at : at + 6]))}"
    )


def _excerpt(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# --- output ----------------------------------------------------------------------------------


def format_report(report: Report, seconds: float | None = None) -> str:
    lines = [
        f"model:    {report.model}",
        f"path:     {_path_label(report.renderer)}",
        f"why:      {report.path_reason}",
        "",
    ]
    width = max([len(r.name) for r in report.rows] + [8])
    lines.append(f"{'scenario':<{width}}  {'api':<9}  {'stream':<6}  {'naive':<6}  tokenkeep")
    for r in report.rows:
        lines.append(
            f"{r.name:<{width}}  {r.api:<9}  {'yes' if r.stream else 'no':<6}  "
            f"{'ok' if r.naive_contiguous else 'BREAK':<6}  {'ok' if r.contiguous else 'BREAK'}"
        )
        if r.tokenkeep_reason:
            lines.append(f"    tokenkeep: {r.tokenkeep_reason}")
        if r.calls_parsed is False:
            lines.append(f"    TOOL CALL NOT PARSED: the harness got {r.first_reply}")
        if r.stream_equal is False:
            lines.append("    STREAMED != NON-STREAMED: see --json")
    naive_reasons = {r.name: r.naive_reason for r in report.rows if r.naive_reason}
    if naive_reasons:
        lines += ["", "naive re-render breaks (first one per scenario):"]
        lines += [f"  {name}: {why}" for name, why in naive_reasons.items()]
    if report.skipped:
        lines += ["", "not applicable to this template:"]
        lines += [f"  {name}: {why}" for name, why in report.skipped.items()]
    naive_broken = sum(not r.naive_contiguous for r in report.rows)
    kept = sum(r.contiguous for r in report.rows)
    timing = f" in {seconds:.1f} s" if seconds is not None else ""
    verdict = "CONTIGUOUS" if report.contiguous else "BREAKS"
    if report.contiguous and not report.ok:
        verdict = "REPLIES WRONG"
    parsed = {True: "yes", False: "NO", None: "n/a (no tool-call scenario)"}
    lines += [
        "",
        f"tool calls parsed as calls: {parsed[report.tool_calls_parsed]}",
        f"streamed = non-streamed:    {parsed[report.stream_equal]}",
        f"verdict: {verdict}: tokenkeep kept {kept} of {len(report.rows)} runs token-exact; "
        f"a naive re-render broke {naive_broken}{timing}",
    ]
    return "\n".join(lines)


def _path_label(renderer: str) -> str:
    if renderer == GENERIC:
        return "generic end-of-turn splice (no hand-written renderer for this family)"
    return f"hand-written renderer {renderer!r}"


# --- start-up check of `tokenkeep serve` ------------------------------------------------------


def cache_key(model: ChatModel) -> str:
    digest = hashlib.sha256()
    folder = Path(str(model.tokenizer.name_or_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).is_file():
            digest.update((folder / name).read_bytes())
    digest.update(str(model.tokenizer.chat_template).encode())
    digest.update(f"{model.family}|{model.template_bridge}|{__version__}".encode())
    return digest.hexdigest()[:32]


def startup_check(
    model: ChatModel,
    cache_dir: Path,
    on_verdict: Callable[[bool], None],
    on_replies: Callable[[bool | None, bool | None], None] | None = None,
) -> bool:
    """The quick scenarios over Chat Completions, streamed and not, cached per tokenizer +
    template hash; logs the verdict and hands it to `on_verdict` (token-exact) and
    `on_replies` (tool calls parsed as calls, streamed = non-streamed; None: not measured)."""
    cache = cache_dir / f"{cache_key(model)}.json"
    cached = False
    try:
        data = json.loads(cache.read_text())
        cached = True
    except (OSError, ValueError):
        report = asyncio.run(
            run_check(model, scenarios=[s for s in SCENARIOS if s.quick], apis=("chat",))
        )
        data = report.as_json()
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(data))
        except OSError as exc:
            log.warning("start-up check: cannot cache the result in %s: %s", cache_dir, exc)
    broken = [s["name"] for s in data["scenarios"] if not s["contiguous"]]
    source = " (cached)" if cached else ""
    parsed, streams = data.get("tool_calls_parsed"), data.get("stream_equal")
    if data["contiguous"]:
        log.info(
            "start-up check%s: token-exact on %d scenarios, path %s (%s)",
            source,
            len(data["scenarios"]),
            _path_label(model.family),
            model.path.reason,
        )
    else:
        log.warning(
            "start-up check%s: tokenkeep BREAKS contiguity on %s (path %s); run `tokenkeep check`",
            source,
            ", ".join(broken) or "every scenario",
            _path_label(model.family),
        )
    if parsed is False:
        log.warning(
            "start-up check%s: tool calls in this model's syntax reach the harness as TEXT on "
            "path %s; run `tokenkeep check`",
            source,
            _path_label(model.family),
        )
    if streams is False:
        log.warning(
            "start-up check%s: streamed replies differ from non-streamed ones on path %s; "
            "run `tokenkeep check`",
            source,
            _path_label(model.family),
        )
    on_verdict(bool(data["contiguous"]))
    if on_replies is not None:
        on_replies(parsed, streams)
    return bool(data["contiguous"])


# --- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import time

    parser = argparse.ArgumentParser(
        prog="tokenkeep check",
        description="Will this model's multi-turn rollouts stay token-exact through tokenkeep?",
    )
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (as for serve)")
    parser.add_argument("--renderer", default="auto", help="auto (default) or a renderer name")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        model = load_model(args.tokenizer, args.renderer)
    except CheckInputError as exc:
        print(f"tokenkeep check: {exc}", file=sys.stderr)
        return 2
    interactive = sys.stderr.isatty()

    def progress(line: str) -> None:
        if interactive:
            print(f"\r\033[Kchecking {line}", end="", file=sys.stderr, flush=True)
        else:
            print(f"checking {line}", file=sys.stderr, flush=True)

    logging.getLogger("tokenkeep").setLevel(logging.ERROR)  # the report says it all
    report = asyncio.run(run_check(model, name=args.tokenizer, progress=progress))
    if interactive:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        print(format_report(report, time.perf_counter() - started))
    if model.path.syntax_unlearned:
        print(
            f"tokenkeep check: TOOL-CALL SYNTAX NOT LEARNED: {model.path.syntax_unlearned}; "
            "tool calls reach the harness as text (serve runs on the generic path)",
            file=sys.stderr,
        )
        return 2
    return 0 if report.ok else 1
