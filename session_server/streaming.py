"""Incremental text of a reply being sampled, split into reasoning and content.

Channels switch on the model's *special tokens* (`<think>`, `</think>`, and any other added
token such as `<tool_call>`), never on decoded text: a literal `<tool_call>` the model
spelled in sub-words is content, exactly as the final token-level parse says. Text after
such a token is held back: tool calls are delivered whole, parsed from token IDs, when the
choice finishes. Bytes of a multibyte
character split across tokens are held until the character is complete. Families whose tool
calls have no start token (Llama 3 writes a bare JSON object) hold back content that opens
with `{` until the final parse says whether it was a call or text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from session_server.conversation import Message
    from session_server.splice import ChatModel

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class TextDelta:
    content: str = ""
    reasoning: str = ""


class ReplyStreamer:
    def __init__(self, model: ChatModel, prompt_ids: list[int] | None = None) -> None:
        vocab = model.tokenizer.get_vocab()
        self._think_start = vocab.get("<think>")
        self._think_end = vocab.get("</think>")
        self._tool_start = vocab.get("<tool_call>")
        self._bare_json_calls = self._tool_start is None
        self._stops = set(model.stop_token_ids)
        # Any other added token opens a channel the final parse owns (tool-call openers:
        # <tool_call>, DeepSeek's <｜tool▁calls▁begin｜>, Mistral's [TOOL_CALLS], ...).
        added = set(getattr(model.tokenizer, "added_tokens_decoder", {}) or {})
        self._holds = added - self._stops - {self._think_start, self._think_end}
        self._decode = model.tokenizer.decode
        # Templates of reasoning models (QwQ, DeepSeek-R1) open `<think>` in the generation
        # prompt itself: the reply then starts inside the reasoning block.
        self._channel = "reasoning" if model.opens_reasoning(prompt_ids or []) else "content"
        self._pending: list[int] = []  # tokens of the current channel not yet decoded fully
        self._content = ""
        self._reasoning = ""
        self._content_started = False

    def feed(self, token_ids: list[int]) -> TextDelta:
        delta = TextDelta()
        for token in token_ids:
            if token in self._stops:
                continue
            if token == self._think_start and self._channel == "content":
                self._emit(delta, final=True)
                self._channel = "reasoning"
            elif token == self._think_end and self._channel == "reasoning":
                self._emit(delta, final=True)
                self._channel = "content"
            elif token in self._holds and self._channel != "tool":
                self._emit(delta, final=True)
                self._channel = "tool"
            elif self._channel != "tool":
                self._pending.append(token)
        self._emit(delta, final=False)
        return delta

    def _emit(self, delta: TextDelta, *, final: bool) -> None:
        if not self._pending:
            return
        text = self._decode(self._pending, skip_special_tokens=False)
        if text.endswith(_REPLACEMENT) and not final:
            return  # the rest of the character is in a later token
        if self._channel == "content" and not self._content_started:
            # Templates and parsers drop whitespace between reasoning and the answer.
            text = text.lstrip()
            if self._bare_json_calls and text.startswith("{"):
                if final:  # the channel changes: the final parse delivers this text
                    self._pending = []
                return  # maybe a tool call: the final parse decides
            self._content_started = bool(text)
        self._pending = []
        if self._channel == "reasoning":
            delta.reasoning += text
            self._reasoning += text
        elif self._channel == "content":
            delta.content += text
            self._content += text

    def finish(self, message: Message) -> TextDelta:
        """What the final parse holds beyond what was streamed (so that the streamed text
        adds up to the parsed reply)."""
        # Held-back tokens are not streamed piecemeal: the final parse is the truth.
        self._pending = []
        tail = TextDelta()
        final_content = message.content or ""
        if final_content.startswith(self._content):
            tail.content = final_content[len(self._content) :]
        final_reasoning = message.reasoning or ""
        if final_reasoning.startswith(self._reasoning):
            tail.reasoning = final_reasoning[len(self._reasoning) :]
        return tail
