"""What the tokenkeep session server hands a trainer, as typed Python objects.

The JSON shapes are the server's (`GET /sessions/{id}/trajectory`, `POST /sessions/export`);
these classes only give them names and types, and turn token data into NumPy arrays.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class WeightSpan:
    """Tokens [start, end) of a segment were sampled by policy `version`."""

    version: str
    start: int
    end: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightSpan:
        return cls(str(data["version"]), int(data["start"]), int(data["end"]))


def decode_routes(encoded: str | None) -> np.ndarray | None:
    """The wire form of MoE routes (base64 of `.npy` bytes, as vLLM sends them) as an array
    (positions, layers, top_k)."""
    if encoded is None:
        return None
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def npy_bytes(array: np.ndarray) -> bytes:
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A created session and where its harness should send requests."""

    id: str
    openai_base_url: str
    """For OpenAI clients (Chat Completions, Responses, Completions)."""
    anthropic_base_url: str
    """For Anthropic clients (Messages)."""
    api_key: str
    """`tk-<id>`: an API key that names the session on the server's `/v1/...` routes."""
    sampling: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    ttl_seconds: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionInfo:
        return cls(
            id=data["id"],
            openai_base_url=data["openai_base_url"],
            anthropic_base_url=data["anthropic_base_url"],
            api_key=data["api_key"],
            sampling=data.get("sampling") or {},
            metadata=data.get("metadata") or {},
            ttl_seconds=data.get("ttl_seconds"),
        )


@dataclass(frozen=True, slots=True)
class Finish:
    finished_at: float
    reward: float | None
    metadata: dict[str, Any]
    status: str = "ok"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finish:
        return cls(
            data["finished_at"],
            data.get("reward"),
            data.get("metadata") or {},
            data.get("status", "ok"),
        )


@dataclass(frozen=True, slots=True)
class FinishedSession:
    id: str
    metadata: dict[str, Any]
    finish: Finish
    first_weight_version: str | None = None
    """The policy version that sampled the rollout's first turn."""
    policy_lag_exceeded: bool = False
    """The engine serves a version more than the server's `--max-policy-lag` past it."""


@dataclass(frozen=True, slots=True)
class ReplicaPolicy:
    """One engine replica in `POST /policy`'s answer or `GET /policy`: the version it serves,
    `state` (serving, updating, behind, fenced), why it gets no turns (`reason`), its
    weight checksum, and (in a publish's answer) the seconds its update took and each
    step's."""

    engine: str
    version: str | None
    state: str
    reason: str | None
    checksum: str | None
    seconds: float | None = None
    steps: dict[str, float] = field(default_factory=dict)
    """A publish's seconds per engine step: pause; reload; cache, version and checksum."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaPolicy:
        return cls(
            str(data["engine"]),
            data.get("version"),
            str(data["state"]),
            data.get("reason"),
            data.get("checksum"),
            data.get("seconds"),
            dict(data.get("steps") or {}),
        )


@dataclass(frozen=True, slots=True)
class Policy:
    """The published policy (`GET /policy`, or what `POST /policy` published): its version
    and source, and each replica's state. `pause_seconds` and `requests` (in-flight
    generations kept, waited for or aborted) come with a publish's answer."""

    version: str | None
    source: dict[str, Any] | None
    replicas: list[ReplicaPolicy]
    published_at: float | None = None
    pause_seconds: float | None = None
    requests: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Policy:
        return cls(
            data.get("version"),
            data.get("source"),
            [ReplicaPolicy.from_json(r) for r in data.get("replicas") or ()],
            data.get("published_at"),
            data.get("pause_seconds"),
            dict(data.get("requests") or {}),
        )


@dataclass(frozen=True, slots=True)
class Aborted:
    """What `POST /sessions/{id}/abort` did: `aborted` generations cut on the server that
    received it (others sharing its Redis cut theirs within a fraction of a second), and the
    finish when it was asked to finish the session too."""

    id: str
    aborted: int
    finish: Finish | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Aborted:
        finish = data.get("finish")
        return cls(data["id"], data["aborted"], Finish.from_json(finish) if finish else None)


@dataclass(frozen=True, slots=True)
class SegmentArrays:
    """One segment as arrays of equal length: what a trainer's forward pass consumes."""

    token_ids: np.ndarray
    """int64 [T]"""
    loss_mask: np.ndarray
    """int8 [T]: 1 where the token was sampled (and is not stale), 0 for context."""
    logprobs: np.ndarray
    """float32 [T]: the sampled token's logprob under the rollout policy; NaN for context."""
    routed_experts: np.ndarray | None = None
    """[T - 1, layers, top_k]: the experts each position was routed to in the rollout (MoE
    routing replay; the last token was never forwarded). None unless the session stores
    routes."""


def _arrays(
    token_ids: Sequence[int],
    loss_mask: Sequence[int],
    logprobs: Sequence[Any],
    routed_experts: np.ndarray | None,
) -> SegmentArrays:
    return SegmentArrays(
        np.asarray(token_ids, dtype=np.int64),
        np.asarray(loss_mask, dtype=np.int8),
        np.array([np.nan if lp is None else lp for lp in logprobs], dtype=np.float32),
        routed_experts,
    )


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous token sequence: the prompt and sampled tokens of consecutive turns."""

    index: int
    start_reason: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    weight_versions: list[WeightSpan]
    """Spans over exactly the sampled positions, by the policy version that sampled them."""
    versions: list[str]
    mixed_versions: bool
    turns: list[dict[str, Any]]
    stale_tokens: int = 0
    routed_experts: np.ndarray | None = None
    """[T - 1, layers, top_k] (see SegmentArrays), or None."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Segment:
        return cls(
            index=data["index"],
            start_reason=data["start_reason"],
            token_ids=data["token_ids"],
            loss_mask=data["loss_mask"],
            logprobs=data["logprobs"],
            weight_versions=[WeightSpan.from_json(s) for s in data.get("weight_versions", ())],
            versions=list(data.get("versions", ())),
            mixed_versions=bool(data.get("mixed_versions")),
            turns=data.get("turns", []),
            stale_tokens=data.get("stale_tokens", 0),
            routed_experts=decode_routes(data.get("routed_experts")),
        )

    def arrays(self) -> SegmentArrays:
        return _arrays(self.token_ids, self.loss_mask, self.logprobs, self.routed_experts)


@dataclass(frozen=True, slots=True)
class Branch:
    """A root-to-leaf path of the session's turn tree, as one or more segments."""

    index: int
    leaf_turn_id: int
    segments: list[Segment]


@dataclass(frozen=True, slots=True)
class Trajectory:
    session_id: str
    branches: list[Branch]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        return cls(
            session_id=data["session_id"],
            branches=[
                Branch(b["index"], b["leaf_turn_id"], [Segment.from_json(s) for s in b["segments"]])
                for b in data["branches"]
            ],
        )


@dataclass(frozen=True, slots=True)
class Row:
    """One line of a batch export: one segment of one finished session."""

    session_id: str
    branch: int
    segment: int
    start_reason: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    weight_versions: list[WeightSpan]
    versions: list[str]
    mixed_versions: bool
    stale_tokens: int
    reward: float | None
    finished_at: float | None
    metadata: dict[str, Any]
    finish_metadata: dict[str, Any]
    leaf_turn_id: int = 0
    routed_experts: np.ndarray | None = None
    """[T - 1, layers, top_k] (see SegmentArrays), or None."""
    status: str | None = None
    """The finish status: `ok`, `env_error`, `model_error` or `aborted`."""
    group: str | None = None
    """The rollout group the session was created in, if any."""
    first_weight_version: str | None = None
    """The policy version that sampled the session's first turn."""
    policy_lag_exceeded: bool = False
    """The engine serves a version more than the server's `--max-policy-lag` past it."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        return cls(
            session_id=data["session_id"],
            branch=data["branch"],
            segment=data["segment"],
            start_reason=data["start_reason"],
            token_ids=data["token_ids"],
            loss_mask=data["loss_mask"],
            logprobs=data["logprobs"],
            weight_versions=[WeightSpan.from_json(s) for s in data["weight_versions"]],
            versions=list(data["versions"]),
            mixed_versions=bool(data["mixed_versions"]),
            stale_tokens=data["stale_tokens"],
            reward=data["reward"],
            finished_at=data["finished_at"],
            metadata=data["metadata"],
            finish_metadata=data["finish_metadata"],
            leaf_turn_id=data["leaf_turn_id"],
            routed_experts=decode_routes(data.get("routed_experts")),
            status=data.get("status"),
            group=data.get("group"),
            first_weight_version=data.get("first_weight_version"),
            policy_lag_exceeded=bool(data.get("policy_lag_exceeded")),
        )

    def arrays(self) -> SegmentArrays:
        return _arrays(self.token_ids, self.loss_mask, self.logprobs, self.routed_experts)


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows stacked into right-padded arrays, ready for a policy-gradient step.

    `attention_mask` is 1 on real tokens; padding has token `pad_id`, loss mask 0 and
    logprob NaN. `rewards` is NaN for a row whose session was finished without one."""

    session_ids: list[str]
    token_ids: np.ndarray
    """int64 [B, T]"""
    attention_mask: np.ndarray
    """int8 [B, T]"""
    loss_mask: np.ndarray
    """int8 [B, T]"""
    logprobs: np.ndarray
    """float32 [B, T]"""
    rewards: np.ndarray
    """float32 [B]"""
    metadata: list[dict[str, Any]]
    groups: list[str | None]
    """Each row's rollout group (for group-relative advantages)."""

    @classmethod
    def from_rows(cls, rows: Iterable[Row], *, pad_id: int = 0) -> Batch:
        rows = list(rows)
        width = max((len(r.token_ids) for r in rows), default=0)
        shape = (len(rows), width)
        token_ids = np.full(shape, pad_id, dtype=np.int64)
        attention = np.zeros(shape, dtype=np.int8)
        loss_mask = np.zeros(shape, dtype=np.int8)
        logprobs = np.full(shape, np.nan, dtype=np.float32)
        for i, row in enumerate(rows):
            arrays = row.arrays()
            n = arrays.token_ids.size
            token_ids[i, :n] = arrays.token_ids
            attention[i, :n] = 1
            loss_mask[i, :n] = arrays.loss_mask
            logprobs[i, :n] = arrays.logprobs
        rewards = np.array(
            [np.nan if r.reward is None else r.reward for r in rows], dtype=np.float32
        )
        return cls(
            session_ids=[r.session_id for r in rows],
            token_ids=token_ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            logprobs=logprobs,
            rewards=rewards,
            metadata=[r.metadata for r in rows],
            groups=[r.group for r in rows],
        )
