"""The one check of an exported trajectory's VALUES against what the engine sampled.

Every tier that exports a trajectory (the session tier on both stores, the API front-ends, the
trainer client, the real vLLM engine) calls `assert_trajectory_values` with the samples its
engine returned: the engine double records them itself (`EngineDouble.samples`), the relay in
front of the real vLLM records them from vLLM's own answers (`tests/integration/relay.py`).

Nothing here reads tokenkeep's code. A segment is correct when, for each turn it lists:
- the tokens before its completion span are exactly the prompt the engine was sent, and the
  span holds exactly the tokens the engine sampled for that prompt;
- each sampled position's logprob is the engine's logprob for that token (as float32: the
  stores keep float32), and every other position's logprob is null;
- `loss_mask` is 1 on exactly the sampled positions;
- the segment's `weight_versions` give each sampled position the version the engine reported
  for it, and cover no other position;
- prompt and completion spans tile the segment in order.
With `every_sample=True`, every sample the engine returned appears in some segment (nothing
sampled was dropped); tests whose engine saw failed or refused turns leave it off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One choice as the engine returned it: the prompt it was sent, the tokens it sampled,
    their logprobs and the policy-version spans (completion coordinates) it reported."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_versions: tuple[tuple[str, int, int], ...] = field(default=())

    def versions(self) -> list[str | None]:
        out: list[str | None] = [None] * len(self.token_ids)
        for version, start, end in self.weight_versions:
            out[start:end] = [version] * (end - start)
        return out


def _f32(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return float(np.float32(value))


def _position_versions(spans: Iterable[dict[str, Any]], length: int) -> list[str | None]:
    out: list[str | None] = [None] * length
    for span in spans:
        for i in range(span["start"], span["end"]):
            assert out[i] is None, f"position {i} is in two version spans"
            out[i] = span["version"]
    return out


def assert_segment_values(segment: dict[str, Any], samples: Sequence[EngineSample]) -> list[int]:
    """Checks one exported segment (see the module docstring); returns the indices of the
    samples its turns were matched to."""
    tokens = list(segment["token_ids"])
    mask = list(segment["loss_mask"])
    logprobs = list(segment["logprobs"])
    assert len(tokens) == len(mask) == len(logprobs), "token_ids, loss_mask, logprobs lengths"
    versions = _position_versions(segment.get("weight_versions") or (), len(tokens))
    expected_mask = [0] * len(tokens)
    expected_logprobs: list[float | None] = [None] * len(tokens)
    expected_versions: list[str | None] = [None] * len(tokens)
    matched: list[int] = []
    position = 0
    for turn in segment["turns"]:
        prompt_start, a = turn["prompt_span"]
        a2, b = turn["completion_span"]
        assert prompt_start == position and a2 == a and b >= a, (
            f"turn spans do not tile the segment: {turn['prompt_span']} {turn['completion_span']}"
        )
        position = b
        prompt, sampled = tuple(tokens[:a]), tuple(tokens[a:b])
        candidates = [
            i
            for i, s in enumerate(samples)
            if s.prompt_ids == prompt and s.token_ids == sampled and i not in matched
        ]
        assert candidates, (
            f"turn {turn.get('turn_id')}: no engine sample has this prompt ({a} tokens) and "
            f"these sampled tokens {sampled[:8]}..."
        )
        # Identical prompt and tokens (n > 1, a retried turn) may differ only in logprobs:
        # the turn must carry one sample's values exactly.
        exported = [_f32(lp) for lp in logprobs[a:b]]
        chosen = next(
            (i for i in candidates if [_f32(lp) for lp in samples[i].logprobs] == exported),
            candidates[0],
        )
        matched.append(chosen)
        sample = samples[chosen]
        expected_mask[a:b] = [1] * (b - a)
        expected_logprobs[a:b] = [_f32(lp) for lp in sample.logprobs]
        expected_versions[a:b] = sample.versions()
    assert position == len(tokens), "the turns' spans do not cover the whole segment"
    assert mask == expected_mask, _first_difference("loss_mask", mask, expected_mask)
    got = [_f32(lp) for lp in logprobs]
    assert got == expected_logprobs, _first_difference("logprobs", got, expected_logprobs)
    assert versions == expected_versions, _first_difference(
        "weight_versions", versions, expected_versions
    )
    return matched


def assert_trajectory_values(
    trajectory: dict[str, Any], samples: Sequence[EngineSample], *, every_sample: bool = False
) -> int:
    """Checks every segment of every branch; returns the number of sampled positions checked
    (so a caller can assert the check was not vacuous)."""
    used: set[int] = set()
    checked = 0
    for branch in trajectory["branches"]:
        for segment in branch["segments"]:
            used.update(assert_segment_values(segment, samples))
            checked += sum(segment["loss_mask"])
    if every_sample:
        # A sample reached by two branches (shared prefix) counts once; identical samples
        # (same prompt, tokens and values) are interchangeable.
        distinct = {(s.prompt_ids, s.token_ids) for s in samples}
        exported = {(samples[i].prompt_ids, samples[i].token_ids) for i in used}
        missing = distinct - exported
        assert not missing, f"{len(missing)} engine samples are in no exported segment"
    return checked


def _first_difference(name: str, got: list[Any], want: list[Any]) -> str:
    at = next((i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y), None)
    if at is None:
        return f"{name}: lengths {len(got)} != {len(want)}"
    return f"{name} differs first at position {at}: exported {got[at]!r}, engine {want[at]!r}"


def version_labels(trajectory: dict[str, Any]) -> list[str]:
    """The policy version of every span of every segment of a trajectory's JSON, in order."""
    return [
        span["version"]
        for branch in trajectory["branches"]
        for segment in branch["segments"]
        for span in segment["weight_versions"]
    ]
