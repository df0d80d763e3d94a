"""Policy versions: the numbers the engine stamps on sampled tokens, and what the core and
the export compute from them (a rollout's first version, turns per version, whether a
prefix-cache hit may have reused positions computed by another policy)."""

from __future__ import annotations

import math

from session_server.store.base import TurnRecord, WeightSpan


def version_number(version: str) -> float | None:
    """The numeric value of a policy version ("7", "7.5"), None if it is not a number."""
    try:
        value = float(version)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def first_weight_version(turns: list[TurnRecord]) -> str | None:
    """The policy version that sampled the rollout's first turn (`turns` in id order)."""
    return turns[0].weight_versions[0].version if turns and turns[0].weight_versions else None


def turns_by_version(turns: list[TurnRecord]) -> dict[str, int]:
    """Turns per policy version (a turn sampled across an update counts for each)."""
    counts: dict[str, int] = {}
    for turn in turns:
        for version in dict.fromkeys(span.version for span in turn.weight_versions):
            counts[version] = counts.get(version, 0) + 1
    return counts


def stale_cache(
    earlier: list[TurnRecord], cached_tokens: int | None, spans: list[WeightSpan]
) -> bool:
    """Whether a turn sampled under the versions `spans`, whose first `cached_tokens` prompt
    positions the engine served from its prefix cache, may have reused positions computed
    under another policy: an earlier turn of its segment (`earlier`, in order) that starts
    inside the cached prefix was sampled under a different version. vLLM does not say which
    version computed a block, so this is tracked from the stored turns."""
    if not cached_tokens or not spans:
        return False
    version = spans[0].version
    start = 0
    for turn in earlier:
        if start >= cached_tokens:
            break
        if any(span.version != version for span in turn.weight_versions):
            return True
        start += len(turn.prompt_delta) + len(turn.completion_ids)
    return False
