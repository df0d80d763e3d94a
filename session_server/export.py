"""Trajectory export: per branch of the turn tree, contiguous token segments for a trainer.

A branch is a root-to-leaf path. Along it, each turn contributes its prompt delta (context:
loss 0, logprob null) then its sampled tokens (loss 1, the sampled token's logprob). A turn
that starts a segment begins a new token sequence, and the segment records why.
"""

from __future__ import annotations

import math
from typing import Any

from session_server.store.base import TurnRecord


def branches(turns: list[TurnRecord]) -> list[list[TurnRecord]]:
    """Root-to-leaf paths, in the order their leaves were created."""
    by_id = {t.turn_id: t for t in turns}
    parents = {t.parent_id for t in turns if t.parent_id is not None}
    paths: list[list[TurnRecord]] = []
    for leaf in turns:
        if leaf.turn_id in parents:
            continue
        path = [leaf]
        while path[-1].parent_id is not None and path[-1].parent_id in by_id:
            path.append(by_id[path[-1].parent_id])
        path.reverse()
        paths.append(path)
    return paths


def segments(path: list[TurnRecord]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for turn in path:
        if current is None or turn.segment_start:
            current = {
                "index": len(out),
                "start_reason": turn.break_reason or "first",
                "token_ids": [],
                "loss_mask": [],
                "logprobs": [],
                "turns": [],
            }
            out.append(current)
        tokens = current["token_ids"]
        prompt_start = len(tokens)
        tokens.extend(turn.prompt_delta)
        current["loss_mask"].extend([0] * len(turn.prompt_delta))
        current["logprobs"].extend([None] * len(turn.prompt_delta))
        completion_start = len(tokens)
        tokens.extend(turn.completion_ids)
        current["loss_mask"].extend([1] * len(turn.completion_ids))
        current["logprobs"].extend(None if math.isnan(lp) else lp for lp in turn.logprobs)
        current["turns"].append(
            {
                "turn_id": turn.turn_id,
                "parent_id": turn.parent_id,
                "kind": turn.kind,
                "api": turn.api,
                "prompt_span": [prompt_start, completion_start],
                "completion_span": [completion_start, len(tokens)],
                "finish_reason": turn.finish_reason,
                "stop_reason": turn.stop_reason,
            }
            | ({"volatile": turn.extra["volatile"]} if "volatile" in turn.extra else {})
        )
    return out


def trajectory(session_id: str, turns: list[TurnRecord]) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "branches": [
            {"index": i, "leaf_turn_id": path[-1].turn_id, "segments": segments(path)}
            for i, path in enumerate(branches(turns))
        ],
    }


def summary(session_id: str, turns: list[TurnRecord]) -> dict[str, Any]:
    paths = branches(turns)
    breaks: dict[str, int] = {}
    for turn in turns:
        if turn.kind == "rewrite" and turn.break_reason:
            breaks[turn.break_reason] = breaks.get(turn.break_reason, 0) + 1
    kinds: dict[str, int] = {}
    for turn in turns:
        kinds[turn.kind] = kinds.get(turn.kind, 0) + 1
    return {
        "turns": len(turns),
        "turns_by_kind": kinds,
        "branches": len(paths),
        "segments": sum(1 for t in turns if t.segment_start),
        "breaks": breaks,
        "tokens": sum(len(t.prompt_delta) + len(t.completion_ids) for t in turns),
        "sampled_tokens": sum(len(t.completion_ids) for t in turns),
    }
