"""What the session core hands back to the API front-ends (non-streaming and streaming).

Front-ends only format these; every decision (lineage, splice, generation, storage) has been
made by `session_server.turns` before they see them.
"""

from __future__ import annotations

from dataclasses import dataclass

from session_server.conversation import Message


@dataclass(slots=True)
class ChoiceResult:
    index: int
    turn_id: int
    message: Message
    """The parsed assistant reply: content, reasoning, tool calls (ids assigned by the core)."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """stop | length | tool_calls (the API's vocabulary; front-ends map it further)."""
    stop_reason: int | str | None = None


@dataclass(slots=True)
class TurnResult:
    session_id: str
    prompt_ids: list[int]
    choices: list[ChoiceResult]
    kind: str
    """first | extend | fork | retry | rewrite"""
    break_reason: str | None
    created: int
    model: str
    response_id: str
    """Unique per request (chatcmpl-/msg_/resp_ ids derive from it); a later Responses
    request may continue from it with `previous_response_id`."""
    parent_turn_id: int | None = None
    return_token_ids: bool = False
    """Whether the reply carries `prompt_token_ids` / `token_ids` (O(history) bytes per turn,
    so harness APIs leave them out unless asked)."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


# --- streaming ---------------------------------------------------------------------------


@dataclass(slots=True)
class StreamStarted:
    """First event: the prompt was accepted by the engine."""

    session_id: str
    prompt_ids: list[int]
    kind: str
    break_reason: str | None
    created: int
    model: str
    n: int
    response_id: str
    return_token_ids: bool = False


@dataclass(slots=True)
class ChoiceDelta:
    """New tokens of one choice and the text they completed.

    `reasoning` and `content` are the newly decodable text on each channel; text that could
    still turn out to be part of a tool-call or reasoning marker is held back until it is
    known. Tool calls are not streamed token by token: they arrive whole in `ChoiceFinished`
    (parsed from the sampled tokens, not from derendered text)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    content: str = ""
    reasoning: str = ""


@dataclass(slots=True)
class ChoiceFinished:
    index: int
    message: Message
    finish_reason: str
    content_tail: str = ""
    """Content that was held back while streaming and is now known to be plain text."""
    reasoning_tail: str = ""


@dataclass(slots=True)
class StreamFinished:
    """Last event: the turns are stored; `result` is what a non-streaming call returns."""

    result: TurnResult


StreamEvent = StreamStarted | ChoiceDelta | ChoiceFinished | StreamFinished
