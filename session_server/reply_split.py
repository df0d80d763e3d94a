"""Incremental text of a reply being sampled, split into reasoning and content.

The rule: what is streamed is always a prefix of what the final token-level parse of the same
tokens says (`ChatModel.parse`), so a client that assembles the stream gets the non-streamed
message, field by field. Text is therefore held back while it could still turn out to be
something else:

- channels switch on the model's *special tokens* (`<think>`, `</think>`, `<tool_call>`); a
  literal `<tool_call>` spelled in sub-words is content, as the parse says. Where the tokenizer
  has no `<think>` token, the parser reads a leading `<think>...</think>` from text, and so
  does the streamer;
- text after a tool-call token, or after any other added token that is not a stop or a
  reasoning marker (DeepSeek's `<｜tool▁calls▁begin｜>`, Mistral's `[TOOL_CALLS]`, ...), is
  never streamed: tool calls arrive whole, parsed from the token IDs, when the choice finishes;
- families whose tool calls are bare JSON (Llama 3: `{"name": ..., "parameters": ...}`) hold
  a reply that starts with `{` until the end, where the parse decides call or text;
- whitespace at the edges of a channel is held until text follows it (parsers strip it; how
  each one does is probed once per model);
- bytes of a multibyte character split across tokens are held until the character is whole;
- harmony (gpt-oss) replies switch channel per message block: a block's header (partly plain
  text, ` to=functions.x`) is held until its `<|message|>`, then its body streams as the
  parser reads it (analysis -> reasoning, final and unaddressed commentary -> content,
  a body addressed to a function -> the call, whole at the end);
- on the generic path, text that may open a call in the syntax learned from the template
  (`session_server/toolsyntax.py`) is held from there on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from session_server.conversation import Message
    from session_server.splice import ChatModel

_REPLACEMENT = "\ufffd"
_OPEN = "<think>"
_CLOSE = "</think>"
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass(slots=True)
class TextDelta:
    content: str = ""
    reasoning: str = ""


class ReplyStreamer:
    def __init__(self, model: ChatModel, prompt_ids: list[int] | None = None) -> None:
        vocab = model.tokenizer.get_vocab()
        self._edges = model.reply_edges
        self._think_start, self._think_end = model.think_ids
        # Markers learned from the template (MiniMax M3's `<mm:think>`): the parser reads
        # only a block that opens the reply, or the closer alone there (an empty block).
        self._opening_block_only = model.reasoning_markers is not None
        self._block_seen = False
        self._text_think = self._edges.text_think
        self._tool_start = vocab.get("<tool_call>")
        self._bare_json_calls = self._tool_start is None
        self._stops = set(model.stop_token_ids)
        # Any other added token opens a channel the final parse owns (tool-call openers:
        # <tool_call>, DeepSeek's <｜tool▁calls▁begin｜>, Mistral's [TOOL_CALLS], ...).
        added = set(getattr(model.tokenizer, "added_tokens_decoder", {}) or {})
        self._holds = added - self._stops - {self._think_start, self._think_end}
        self._decode = model.tokenizer.decode
        # Templates of reasoning models (QwQ, DeepSeek-R1, GLM) open `<think>` in the
        # generation prompt itself: the reply then starts inside the reasoning block.
        self._channel = "reasoning" if model.opens_reasoning(prompt_ids or []) else "content"
        self._header: list[int] = []  # harmony: the open block's header so far
        self._pending: list[int] = []  # tokens of the current channel not yet decoded fully
        self._text = {"content": "", "reasoning": ""}
        self._sent = {"content": "", "reasoning": ""}
        self._any_text = False  # a text-level <think> only opens a reply
        self._whole = False  # held to the end: the final parse alone says what it is
        self._harmony = _Harmony(model) if model.family == "gpt-oss" else None
        if self._harmony is not None:
            self._channel, self._header = self._harmony.opening(prompt_ids or [])
        # A tool-call syntax learned from the template: text that may open a call (spelled
        # in text, as functionary's `<function=`) is held until the final parse decides.
        self._calls = model.learned_calls

    def feed(self, token_ids: list[int]) -> TextDelta:
        if self._harmony is not None:
            self._feed_harmony(token_ids)
        else:
            self._feed_tokens(token_ids)
        if self._whole:
            return TextDelta()
        self._decode_pending(final=False)
        return self._release()

    def _feed_tokens(self, token_ids: list[int]) -> None:
        for token in token_ids:
            if token in self._stops:
                continue
            if self._opening_block_only and token in (self._think_start, self._think_end):
                self._learned_marker(token)
            elif token == self._think_start and self._channel == "content" and not self._text_think:
                self._flush()
                self._channel = "reasoning"
                if self._edges.lead_to_reasoning and not self._text["content"].strip():
                    # The parser reads whitespace before `<think>` as the reasoning's.
                    self._text["reasoning"] += self._text["content"]
                    self._text["content"] = ""
            elif token == self._think_end and self._channel == "reasoning" and not self._text_think:
                self._flush()
                self._channel = "content"
            elif token in self._holds and self._channel != "tool":
                self._flush()
                self._channel = "tool"
            elif self._channel != "tool":
                self._pending.append(token)

    def _learned_marker(self, token: int) -> None:
        if self._channel == "reasoning" and token == self._think_end:
            self._flush()
            self._channel = "content"
            self._block_seen = True
            return
        self._flush()
        if self._block_seen or self._channel != "content" or self._text["content"].strip():
            self._pending.append(token)  # past the reply's start: text to the parser
            return
        self._text["content"] = ""  # whitespace before the block is no content
        self._channel = "reasoning" if token == self._think_start else "content"
        self._block_seen = True

    def _feed_harmony(self, token_ids: list[int]) -> None:
        """Harmony blocks, as `renderers`' gpt-oss parser walks them: `<|start|>` header
        `<|message|>` body, closed by `<|end|>`/`<|call|>` or the next `<|start|>`; nothing
        after `<|return|>`."""
        harmony = self._harmony
        assert harmony is not None
        for token in token_ids:
            if self._whole or self._channel == "done":
                return
            if token == harmony.ret:  # the parser reads nothing after it
                self._flush()
                self._channel = "done"
            elif self._channel == "opening" and token != harmony.start:
                # Neither the prompt nor the reply opens a block: the parser reads the
                # whole reply as content, at the end.
                self._whole = True
            elif self._channel == "header":
                if token == harmony.message:
                    self._channel = harmony.channel_of(self._header)
                else:
                    self._header.append(token)
            elif token == harmony.start:
                self._flush()
                self._channel, self._header = "header", []
            elif token in (harmony.end, harmony.call):
                self._flush()
                self._channel = "between"
            elif self._channel in ("content", "reasoning"):
                self._pending.append(token)

    def _flush(self) -> None:
        self._decode_pending(final=True)

    def _decode_pending(self, *, final: bool) -> None:
        if not self._pending:
            return
        text = self._decode(self._pending, skip_special_tokens=False)
        if text.endswith(_REPLACEMENT) and not final:
            return  # the rest of the character is in a later token
        self._pending = []
        if self._channel in self._text:
            self._text[self._channel] += text
        if self._text_think:
            self._split_text_think()

    def _split_text_think(self) -> None:
        """Parsers without a `<think>` token read a reasoning block that opens the reply."""
        if self._channel == "content" and not self._any_text:
            head = self._text["content"].lstrip()
            if head.startswith(_OPEN):
                self._channel = "reasoning"
                self._text["content"] = ""
                self._text["reasoning"] += head[len(_OPEN) :]
            elif head and not _OPEN.startswith(head):
                self._any_text = True
        if self._channel == "reasoning":
            self._any_text = True
            reasoning, closed, after = self._text["reasoning"].partition(_CLOSE)
            if closed:
                self._text["reasoning"] = reasoning
                self._text["content"] += after
                self._channel = "content"

    def _release(self) -> TextDelta:
        return TextDelta(
            content=self._advance("content", self._releasable_content()),
            reasoning=self._advance("reasoning", self._releasable_reasoning()),
        )

    def _advance(self, channel: str, releasable: str) -> str:
        sent = self._sent[channel]
        if len(releasable) <= len(sent) or not releasable.startswith(sent):
            return ""
        self._sent[channel] = releasable
        return releasable[len(sent) :]

    def _releasable_content(self) -> str:
        text = self._text["content"]
        if self._harmony is not None:
            return text.strip()  # the parser strips the joined bodies
        if self._text_think and not self._any_text:
            return ""  # could still open a text-level reasoning block
        if self._edges.strips_content:
            text = text.lstrip()
        if self._bare_json_calls and text.lstrip().startswith("{"):
            return ""  # may be a whole tool call; the final parse decides
        if self._calls is not None:
            text = text[: self._calls.hold_from(text)]
        text = text.rstrip()
        # A trailing `<` may open a marker whose rest is a special token (DeepSeek V4's
        # `<｜DSML｜...`): held until the next token says which.
        return text[:-1].rstrip() if text.endswith("<") else text

    def _releasable_reasoning(self) -> str:
        text = self._text["reasoning"]
        if self._harmony is not None:
            return text.strip()
        if self._edges.strips_reasoning:
            text = text.lstrip()
        if self._channel != "reasoning" and text:
            # Closed: nothing more can follow, and the held edge must go out now, before
            # any content (front-ends open a new reasoning block for late reasoning text).
            # Whitespace alone is no reasoning to a parser.
            if not text.strip():
                return ""
            return text.rstrip() if self._edges.strips_reasoning else text
        if self._text_think and self._channel == "reasoning":
            for size in range(len(_CLOSE) - 1, 0, -1):
                if text.endswith(_CLOSE[:size]):
                    text = text[:-size]  # maybe the start of the closing marker
                    break
        return text.rstrip()

    def finish(self, message: Message) -> TextDelta:
        """What the final parse holds beyond what was streamed (so that the streamed text
        adds up to the parsed reply)."""
        self._flush()
        tail = TextDelta()
        for channel, final in (("content", message.content), ("reasoning", message.reasoning)):
            final = final or ""
            sent = self._sent[channel]
            if final.startswith(sent):
                setattr(tail, channel, final[len(sent) :])
        return tail


class _Harmony:
    """gpt-oss's harmony markers and how a block's header names its channel."""

    def __init__(self, model: ChatModel) -> None:
        ids = model.tokenizer.convert_tokens_to_ids
        self.start, self.message = ids("<|start|>"), ids("<|message|>")
        self.end, self.call, self.ret = ids("<|end|>"), ids("<|call|>"), ids("<|return|>")
        self.channel = ids("<|channel|>")
        self._decode = model.tokenizer.decode

    def opening(self, prompt_ids: list[int]) -> tuple[str, list[int]]:
        """(channel, header so far) where the reply starts, as `splice.parse_reply` reads
        it: inside the header the generation prompt opened (the official template's
        `<|start|>assistant`), in the body of the block the prompt opened whole (the
        renderer's `...<|channel|>analysis<|message|>`), or before any block ("opening")."""
        if self.start not in prompt_ids:
            return "opening", []
        at = len(prompt_ids) - 1 - prompt_ids[::-1].index(self.start)
        tail = prompt_ids[at + 1 :]
        if self.message not in tail:
            return ("header", tail) if at >= len(prompt_ids) - 4 else ("opening", [])
        return self.channel_of(tail[: tail.index(self.message)]), []

    def channel_of(self, header: list[int]) -> str:
        """The stream channel of a block's body, as the parser reads its header."""
        text = self._decode(header, skip_special_tokens=False)
        recipient = _RECIPIENT.search(text)
        if recipient and recipient.group(1).startswith("functions."):
            return "tool"  # a call: arrives whole from the final parse
        name = ""
        if self.channel in header:
            after = self._decode(
                header[header.index(self.channel) + 1 :], skip_special_tokens=False
            ).split()
            name = after[0] if after else ""
        if name == "analysis":
            return "reasoning"
        return "content" if name in ("final", "commentary") else "between"
