"""Builders of TurnRecords for the store tests."""

from __future__ import annotations

import random

from session_server.store.base import SessionMeta, TurnRecord


def meta(session_id: str, ttl_seconds: int | None = None) -> SessionMeta:
    return SessionMeta(
        session_id=session_id,
        created_at=1_700_000_000.25,
        ttl_seconds=ttl_seconds,
        sampling_overrides={"temperature": 1.0},
        metadata={"task": "swe", "attempt": 3},
        normalization=[{"pattern": "cch=[0-9a-f]+", "replace": "cch="}],
    )


def turn(
    parent_id: int | None,
    *,
    n_prompt: int = 5,
    n_completion: int = 3,
    segment_start: bool | None = None,
    kind: str | None = None,
    break_reason: str | None = None,
    seed: int = 0,
) -> TurnRecord:
    """A turn with distinct, seed-dependent tokens and logprobs exactly representable in
    float32 (so stored values compare equal to what was passed)."""
    rng = random.Random(seed)
    if segment_start is None:
        segment_start = parent_id is None
    return TurnRecord(
        turn_id=0,
        parent_id=parent_id,
        segment_start=segment_start,
        kind=kind or ("first" if parent_id is None else "extend"),
        break_reason=break_reason,
        prompt_delta=[rng.randrange(151_936) for _ in range(n_prompt)],
        completion_ids=[rng.randrange(151_936) for _ in range(n_completion)],
        logprobs=[-rng.randrange(1, 4096) / 256 for _ in range(n_completion)],
        finish_reason="stop",
        stop_reason=151_645,
        n_messages=2,
        created_at=1_700_000_000.5 + seed,
        extra={"seed": seed},
    )
