"""What every OpenAI-shaped reply (Chat, Completions, generate) carries besides its choices."""

from __future__ import annotations

from typing import Any

from session_server.results import StreamStarted, TurnResult


def usage(result: TurnResult) -> dict[str, int]:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def tokenkeep_info(source: TurnResult | StreamStarted) -> dict[str, Any]:
    """The reply's `tokenkeep` object: how the turn was classified and, once stored, the
    ids of its turns (one per choice)."""
    info: dict[str, Any] = {"kind": source.kind, "break_reason": source.break_reason}
    if isinstance(source, TurnResult):
        info["turn_ids"] = [c.turn_id for c in source.choices]
    return info
