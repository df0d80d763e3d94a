"""The split every adapter shares: an exported row (one segment of a finished session) as the
prompt the engine was first sent and the response after it."""

from __future__ import annotations

from dataclasses import dataclass

from tokenkeep.types import Row


@dataclass(frozen=True, slots=True)
class Split:
    prompt_ids: list[int]
    """The row's tokens before its first sampled token: the engine's first prompt."""
    response_ids: list[int]
    """The rest: sampled tokens and the context after them (tool results, later prompts)."""
    response_mask: list[int]
    """The row's loss mask over the response: 1 where sampled (and not stale), 0 on context."""
    response_logprobs: list[float]
    """The rollout's logprob of each sampled response token; 0.0 on context tokens."""
    start: int
    """Where the response starts in the row's tokens."""


def split(row: Row) -> Split:
    """Raises ValueError for a row with no sampled token (nothing to train on), or a sampled
    token without the rollout's logprob (the importance ratio needs it: none is invented)."""
    if 1 not in row.loss_mask:
        raise ValueError(
            f"session {row.session_id} segment {row.segment} has no sampled token to train on"
        )
    start = row.loss_mask.index(1)
    mask = row.loss_mask[start:]
    logprobs: list[float] = []
    for offset, (sampled, lp) in enumerate(zip(mask, row.logprobs[start:], strict=True)):
        if not sampled:
            logprobs.append(0.0)
        elif lp is None:
            raise ValueError(
                f"session {row.session_id} segment {row.segment}: sampled token at "
                f"{start + offset} has no logprob"
            )
        else:
            logprobs.append(lp)
    return Split(row.token_ids[:start], row.token_ids[start:], mask, logprobs, start)


def reward(row: Row) -> float:
    """The finish reward, for trainers that need a number (ValueError when finished without)."""
    if row.reward is None:
        raise ValueError(f"session {row.session_id} was finished without a reward")
    return row.reward
