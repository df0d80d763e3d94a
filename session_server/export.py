"""Trajectory export: per branch of the turn tree, contiguous token segments for a trainer.

A branch is a root-to-leaf path. Along it, each turn contributes its prompt delta (context:
loss 0, logprob null) then its sampled tokens (loss 1, the sampled token's logprob). A turn
that starts a segment begins a new token sequence, and the segment records why.

Policy versions: each segment lists `weight_versions`, spans `{"version", "start", "end"}` in
the segment's token coordinates that cover exactly its sampled positions (a prompt token has
no version), `versions` (the distinct ones, in order of first use) and `mixed_versions`.
A `Staleness` filter treats sampled tokens of a version below `min_version` (or of no known
version) as stale: `mask` keeps them as context (loss 0) and counts them, `drop` leaves out
every segment that holds one (a segment is one training sequence: it cannot lose a middle).

MoE routing replay: a segment of a session that stores routes has `routed_experts`, base64 of
`.npy` bytes (vLLM's own encoding) of an array (T - 1, layers, top_k) for its T tokens: row i
holds the experts position i was routed to when the rollout forwarded it (the last token was
sampled, never forwarded). It is null when any turn of the segment lacks routes.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from session_server.store.base import Finish, SessionMeta, TurnRecord, WeightSpan
from session_server.versions import (
    first_weight_version,
    stale_cache,
    turns_by_version,
    version_number,
)


@dataclass(slots=True, frozen=True)
class Staleness:
    """Sampled tokens of a version below `min_version` are stale; so are tokens whose
    version is unknown or not a number (nothing proves them fresh)."""

    min_version: float
    action: Literal["mask", "drop"] = "mask"

    def stale(self, version: str | None) -> bool:
        number = None if version is None else version_number(version)
        return number is None or number < self.min_version


def _sampled_versions(turn: TurnRecord) -> list[str | None]:
    """The version of each completion token (None where the engine reported none)."""
    versions: list[str | None] = [None] * len(turn.completion_ids)
    for span in turn.weight_versions:
        versions[span.start : span.end] = [span.version] * (span.end - span.start)
    return versions


def encode_routes(experts: np.ndarray) -> str:
    with io.BytesIO() as buffer:
        np.save(buffer, experts, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def _segment_routes(path: list[TurnRecord], length: int) -> str | None:
    """The segment's turns' routes end to end, if they cover positions [0, length - 1)."""
    end = 0
    parts = []
    for turn in path:
        routes = turn.routed_experts
        if routes is None or routes.start != end:
            return None
        parts.append(routes.experts)
        end = routes.end
    if end != length - 1 or not parts:
        return None
    return encode_routes(np.concatenate(parts) if len(parts) > 1 else parts[0])


def _shifted(spans: list[WeightSpan], offset: int) -> list[dict[str, Any]]:
    return [{"version": s.version, "start": s.start + offset, "end": s.end + offset} for s in spans]


def _image_entry(image: dict[str, Any], prompt_start: int) -> dict[str, Any]:
    """An image the turn's prompt added: its hash (`GET /sessions/{id}/images/{sha256}`),
    its placeholder run in segment coordinates, and its original size."""
    return {
        "sha256": image["sha256"],
        "offset": prompt_start + image["offset"],
        "length": image["length"],
        "width": image["width"],
        "height": image["height"],
    }


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


def segments(path: list[TurnRecord], staleness: Staleness | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    members: list[list[TurnRecord]] = []
    current: dict[str, Any] | None = None
    for turn in path:
        if current is None or turn.segment_start:
            members.append([])
            current = {
                "index": len(out),
                "start_reason": turn.break_reason or "first",
                "token_ids": [],
                "loss_mask": [],
                "logprobs": [],
                "weight_versions": [],
                "versions": [],
                "mixed_versions": False,
                "turns": [],
            }
            if staleness is not None:
                current["stale_tokens"] = 0
            out.append(current)
        earlier = list(members[-1])
        members[-1].append(turn)
        tokens = current["token_ids"]
        prompt_start = len(tokens)
        tokens.extend(turn.prompt_delta)
        current["loss_mask"].extend([0] * len(turn.prompt_delta))
        current["logprobs"].extend([None] * len(turn.prompt_delta))
        completion_start = len(tokens)
        tokens.extend(turn.completion_ids)
        mask = [1] * len(turn.completion_ids)
        stale = 0
        if staleness is not None:
            for i, version in enumerate(_sampled_versions(turn)):
                if staleness.stale(version):
                    mask[i] = 0
                    stale += 1
            current["stale_tokens"] += stale
        current["loss_mask"].extend(mask)
        current["logprobs"].extend(None if math.isnan(lp) else lp for lp in turn.logprobs)
        spans = _shifted(turn.weight_versions, completion_start)
        merged = current["weight_versions"]
        for span in spans:
            if (
                merged
                and merged[-1]["end"] == span["start"]
                and (merged[-1]["version"] == span["version"])
            ):
                merged[-1]["end"] = span["end"]
            else:
                merged.append(dict(span))
            if span["version"] not in current["versions"]:
                current["versions"].append(span["version"])
        current["mixed_versions"] = len(current["versions"]) > 1
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
                "weight_versions": spans,
            }
            | _cache_facts(earlier, turn)
            | ({"stale_tokens": stale} if staleness is not None else {})
            | ({"volatile": turn.extra["volatile"]} if "volatile" in turn.extra else {})
            | (
                {"images": [_image_entry(image, prompt_start) for image in turn.extra["images"]]}
                if "images" in turn.extra
                else {}
            )
        )
    for segment, turns in zip(out, members, strict=True):
        segment["routed_experts"] = _segment_routes(turns, len(segment["token_ids"]))
    if staleness is not None and staleness.action == "drop":
        out = [segment for segment in out if not segment["stale_tokens"]]
    return out


Branches = Literal["all", "last"]
"""Which branches an export holds: every root-to-leaf path, or only the path to the most
recently stored turn (one leaf per rollout: the retries and forks before it left out)."""


def _cache_facts(earlier: list[TurnRecord], turn: TurnRecord) -> dict[str, Any]:
    cached = turn.extra.get("cached_tokens")
    return {
        "cached_tokens": cached,
        "stale_cache": stale_cache(earlier, cached, turn.weight_versions),
    }


def trajectory(
    session_id: str,
    turns: list[TurnRecord],
    staleness: Staleness | None = None,
    which: Branches = "all",
) -> dict[str, Any]:
    exported = []
    paths = branches(turns)
    if which == "last" and paths:
        # Children are stored after their parents, so the newest turn is always a leaf.
        newest = max(turn.turn_id for turn in turns)
        paths = [path for path in paths if path[-1].turn_id == newest]
    for path in paths:
        kept = segments(path, staleness)
        if kept or staleness is None or staleness.action != "drop":
            exported.append(
                {"index": len(exported), "leaf_turn_id": path[-1].turn_id, "segments": kept}
            )
    return {"session_id": session_id, "branches": exported}


def rows(
    meta: SessionMeta,
    finish: Finish | None,
    turns: list[TurnRecord],
    staleness: Staleness | None = None,
    which: Branches = "all",
) -> list[dict[str, Any]]:
    """One flat row per segment of every branch (or of the last one): what the batch export
    writes (JSONL lines, Parquet rows). The session's and the finish's facts repeat on each
    of its rows."""
    out: list[dict[str, Any]] = []
    for branch in trajectory(meta.session_id, turns, staleness, which)["branches"]:
        for segment in branch["segments"]:
            out.append(
                {
                    "session_id": meta.session_id,
                    "branch": branch["index"],
                    "leaf_turn_id": branch["leaf_turn_id"],
                    "segment": segment["index"],
                    "start_reason": segment["start_reason"],
                    "token_ids": segment["token_ids"],
                    "loss_mask": segment["loss_mask"],
                    "logprobs": segment["logprobs"],
                    "weight_versions": segment["weight_versions"],
                    "versions": segment["versions"],
                    "mixed_versions": segment["mixed_versions"],
                    "stale_tokens": segment.get("stale_tokens", 0),
                    "routed_experts": segment["routed_experts"],
                    "reward": finish.reward if finish else None,
                    "status": finish.status if finish else None,
                    "group": meta.group,
                    "group_size": meta.group_size,
                    "finished_at": finish.finished_at if finish else None,
                    "first_weight_version": first_weight_version(turns),
                    "metadata": meta.metadata,
                    "finish_metadata": finish.metadata if finish else {},
                }
            )
    return out


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
        "turns_by_weight_version": turns_by_version(turns),
        "prefix_cache_hit_ratio": prefix_cache_hit_ratio(paths),
    }


def prefix_cache_hit_ratio(paths: list[list[TurnRecord]]) -> float | None:
    """Cached prompt tokens / prompt tokens over the turns whose engine reported its prefix
    cache (None: none did)."""
    prompt = cached = 0
    seen: set[int] = set()
    for path in paths:
        length = 0
        for turn in path:
            if turn.segment_start:
                length = 0
            length += len(turn.prompt_delta)
            if turn.turn_id not in seen and "cached_tokens" in turn.extra:
                seen.add(turn.turn_id)
                prompt += length
                cached += int(turn.extra["cached_tokens"])
            length += len(turn.completion_ids)
    return round(cached / prompt, 4) if prompt else None
