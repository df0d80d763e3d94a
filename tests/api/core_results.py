"""Core results built by hand, to test the front-ends' formatting on its own.

These are the values `session_server.turns` hands to a front-end (`TurnResult` and the
stream events); building them directly pins every field the wire format depends on
(stop strings, reasoning, several tool calls) without needing an engine to sample them.
End-to-end tests drive the same formatters through the real core.
"""

from __future__ import annotations

from session_server.conversation import Message, ToolCall
from session_server.results import (
    ChoiceDelta,
    ChoiceFinished,
    ChoiceResult,
    StreamEvent,
    StreamFinished,
    StreamStarted,
    TurnResult,
)

PROMPT_IDS = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]


def turn_result(
    message: Message,
    *,
    finish_reason: str = "stop",
    stop_reason: int | str | None = 151645,
    token_ids: list[int] | None = None,
    response_id: str = "0123abcd",
    return_token_ids: bool = True,
) -> TurnResult:
    token_ids = token_ids if token_ids is not None else [11, 12, 13, 151645]
    return TurnResult(
        session_id="s1",
        prompt_ids=list(PROMPT_IDS),
        choices=[
            ChoiceResult(
                index=0,
                turn_id=1,
                message=message,
                token_ids=token_ids,
                logprobs=[-0.5] * len(token_ids),
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
        ],
        kind="first",
        break_reason=None,
        created=1_700_000_000,
        model="tiny-qwen3",
        response_id=response_id,
        return_token_ids=return_token_ids,
    )


def stream_events(
    result: TurnResult, *, reasoning_pieces: list[str], content_pieces: list[str]
) -> list[StreamEvent]:
    """The events a streaming request yields for `result`: reasoning, then content, sent in
    pieces (the last content piece held back to `ChoiceFinished.content_tail`, as the core
    does with text that might have started a tool-call marker)."""
    choice = result.choices[0]
    events: list[StreamEvent] = [
        StreamStarted(
            session_id=result.session_id,
            prompt_ids=result.prompt_ids,
            kind=result.kind,
            break_reason=None,
            created=result.created,
            model=result.model,
            n=1,
            response_id=result.response_id,
            return_token_ids=result.return_token_ids,
        )
    ]
    for piece in reasoning_pieces:
        events.append(ChoiceDelta(index=0, token_ids=[1], logprobs=[-0.1], reasoning=piece))
    for piece in content_pieces[:-1]:
        events.append(ChoiceDelta(index=0, token_ids=[2], logprobs=[-0.1], content=piece))
    events.append(
        ChoiceFinished(
            index=0,
            message=choice.message,
            finish_reason=choice.finish_reason,
            content_tail=content_pieces[-1] if content_pieces else "",
        )
    )
    events.append(StreamFinished(result=result))
    return events


def weather_call(call_id: str = "call_w1", city: str = "Paris") -> ToolCall:
    return ToolCall(id=call_id, name="get_weather", arguments='{"city":"' + city + '"}')


async def aiter_events(events: list[StreamEvent]):
    for event in events:
        yield event
