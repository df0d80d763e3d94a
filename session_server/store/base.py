"""What the session core stores, and the interface every store implements.

A session is a tree of turns. Each turn stores only what it added to the token stream:
`prompt_delta` (the tokens between its parent's last sampled token and its own first
sampled token) and `completion_ids` (what the engine sampled). A turn that starts a new
segment (`segment_start`) stores its whole prompt as `prompt_delta`. The token prompt of any
turn is therefore the concatenation, from the nearest segment start down to the turn, of
`prompt_delta + completion_ids` of each ancestor, then its own `prompt_delta`. Storage grows
with total tokens, never with turns x history.

Lookup keys are opaque strings computed by the core (`session_server.conversation`):
- a *reply key* names the conversation up to and including a turn's reply;
- an *input key* names the conversation a turn was sampled from (retry detection).
The first turn stored under a key keeps it (`HSETNX` semantics).

Stored records never change, so a caller may keep the records it has seen in a `RecordCache`
and hand it to `lookup`, which then neither transfers nor decodes them again. Because a session
id can be deleted and created again (turn ids restart at 1), every session gets a random
*incarnation* token at creation, and a cache only counts for the incarnation it was filled from.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

import numpy as np


@dataclass(slots=True)
class TurnRecord:
    """One sampled completion and the prompt tokens it added."""

    turn_id: int
    """Allocated by the store at append time: 1, 2, 3... per session. 0 before that."""
    parent_id: int | None
    """The turn this one continues in the turn tree (None for a root)."""
    segment_start: bool
    """True when `prompt_delta` is a whole prompt rather than an extension of the parent."""
    kind: str
    """first | extend | fork | retry | rewrite."""
    break_reason: str | None
    """Why a new segment started (None unless `segment_start` and not the session's first)."""
    prompt_delta: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """One per completion token: the sampled token's logprob (NaN if the engine gave none)."""
    finish_reason: str
    stop_reason: int | str | None = None
    n_messages: int = 0
    """How many request messages this turn's input had (its reply is message n_messages)."""
    created_at: float = field(default_factory=time.time)
    api: str = "chat"
    """Which front-end produced the turn: chat | responses | messages | completions."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Small JSON-serialisable facts: timings, response id, normalisation notes."""
    weight_versions: list[WeightSpan] = field(default_factory=list)
    """Which policy version sampled which completion tokens, as the engine reported it
    (vLLM's per-choice `weight_versions`), in completion coordinates; [] if it reported
    none (an older engine, the /v1/completions fallback)."""
    routed_experts: RoutedExperts | None = None
    """MoE routing replay (sessions that ask for it): the experts of the positions this turn
    forwarded first."""


@dataclass(slots=True, frozen=True)
class WeightSpan:
    """Completion tokens [start, end) were sampled by policy `version`."""

    version: str
    start: int
    end: int


@dataclass(slots=True)
class SessionMeta:
    session_id: str
    created_at: float
    ttl_seconds: int | None
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    normalization: list[dict[str, Any]] = field(default_factory=list)
    """Volatile-prompt rules (see session_server.conversation); empty = off."""
    return_token_ids: bool | None = None
    """Replies carry `prompt_token_ids` / `token_ids` unless a request says otherwise
    (None: each API's default)."""
    key_hash: str = ""
    """SHA-256 of the session's API key (session_server.api.auth); empty: none issued."""
    routed_experts: bool = False
    """MoE routing replay: ask the engine for each turn's expert routes and store them."""
    reasoning_ended: bool | None = None
    """Turns are sent with vLLM's `reasoning_ended` unless a request says otherwise: a
    `tool_choice` or structured-output constraint applies from the first sampled token."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables every turn's chat template renders with (`enable_thinking`), under the
    request's own `chat_template_kwargs`, key by key."""
    group: str | None = None
    """The rollout group (the G samples of one prompt) this session belongs to."""
    group_size: int | None = None
    """How many sessions the group has: it is complete when that many are finished."""
    incarnation: str | None = field(default=None, compare=False)
    """The incarnation token the store gave this creation of the session (filled in by
    `create_session` / `get_session`, not part of the stored metadata): a server that caches
    the metadata compares it with a lookup's to notice a delete and re-create elsewhere."""


def new_incarnation() -> str:
    """A fresh incarnation token: 16 random hex digits, so that two creations of one
    session id, by any server process, never share one."""
    return secrets.token_hex(8)


@dataclass(slots=True)
class RecordCache:
    """The decoded records of one session that a caller already holds, for `lookup`.

    `lookup` fills it: it adds every record it decodes, and when `incarnation` is not the
    session's current one it drops the old records and takes the session's incarnation.
    The records are shared with every LookupResult built from the cache, so nobody may
    mutate them."""

    incarnation: str | None = None
    """The session incarnation the records belong to; None = not known yet (never matches)."""
    records: dict[int, TurnRecord] = field(default_factory=dict)
    """Turn id -> record, as stored in that incarnation."""
    tokens_json: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    """Turn id -> (token count, JSON array) of every token through that turn, prompt and
    reply, as sent to the engine: the next turn sends these bytes and its own new tokens
    instead of encoding the whole history again. Only the latest turn's are kept."""

    def learn(self, incarnation: str | None, decoded: dict[int, TurnRecord]) -> None:
        """Take in the records a lookup decoded from a session of `incarnation`.

        A new incarnation replaces `records` with a new dict rather than emptying it in
        place: a lookup still awaiting its reply keeps reading the dict it announced, so
        `records` only ever holds records of `incarnation`, even under concurrent lookups."""
        if incarnation is not None and incarnation == self.incarnation:
            self.records.update(decoded)
        else:
            self.incarnation = incarnation
            self.records = decoded
            self.tokens_json = {}


@dataclass(slots=True)
class LookupResult:
    """What one lookup round trip found."""

    parent_path: list[TurnRecord]
    """Root-to-turn records of the deepest turn whose reply key was among the reply keys
    asked for, or [] if none matched. Contains every record on the path (older segments
    too), in root-first order."""
    matched_key_index: int | None
    """Position, in the reply keys asked for, of the key that matched (None if none)."""
    retry_of: TurnRecord | None
    """The first turn stored under the input key asked for, if any."""
    retry_path: list[TurnRecord] = field(default_factory=list)
    """Root-to-turn records of `retry_of`'s parent ([] if it is a root or retry_of is None)."""
    turn_count: int = 0
    """How many turns the session holds."""
    parent_children: int = 0
    """How many turns continue the last turn of `parent_path` (0 when it is a leaf or when
    nothing matched): the core tells an extension of a leaf from a fork by it."""
    incarnation: str | None = None
    """The session's incarnation token (None only for a Redis session created by a server
    version that predates incarnations: such a session never uses a cache)."""
    finished: bool = False
    """The session is finished: nothing more may be appended to it."""


@dataclass(slots=True)
class SessionCounters:
    turns: int
    segments: int
    """How many stored turns have `segment_start`."""
    breaks: dict[str, int]
    """Turns per `break_reason` (turns without one are not counted)."""
    tokens: int
    """Tokens stored: the sum of len(prompt_delta) + len(completion_ids) over all turns."""


@dataclass(slots=True, eq=False)
class RoutedExperts:
    """The experts an MoE engine routed positions [start, start + len(experts)) of the turn's
    segment to, `experts[i, layer, k]`. A turn holds the positions its own request forwarded
    first: from its parent's last sampled token (the parent's request sampled it but never
    forwarded it) to its own last token but one; a segment's first turn starts at 0."""

    start: int
    experts: np.ndarray
    """(positions, layers, top_k), unsigned integers."""

    @property
    def end(self) -> int:
        return self.start + int(self.experts.shape[0])

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RoutedExperts)
            and self.start == other.start
            and self.experts.shape == other.experts.shape
            and bool(np.array_equal(self.experts, other.experts))
        )


@dataclass(slots=True)
class Finish:
    """A finished rollout: when, its reward, what the driver said about it."""

    finished_at: float
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"
    """`ok`, or why the rollout failed: `env_error`, `model_error`, `aborted` (FINISH_STATUSES)."""
    first_weight_version: str | None = None
    """The policy version that sampled the rollout's first turn (None: no turn, or the engine
    reported none), kept so that finished listings show the policy lag without reading turns."""


FinishStatus = Literal["ok", "env_error", "model_error", "aborted"]
FINISH_STATUSES: tuple[str, ...] = get_args(FinishStatus)


class SessionNotFound(KeyError):
    pass


class SessionExists(ValueError):
    pass


class AlreadyFinished(ValueError):
    """`finish_session` on a session that is finished already; nothing was changed."""


class SessionFinished(ValueError):
    """`append_turns` to a finished session: a finished rollout is final; nothing was stored."""


class UnknownParent(ValueError):
    """An appended turn names a parent the session does not hold; nothing was stored."""


class KeyTaken(ValueError):
    """`append_turns(..., unless_key=k)` found `k` already stored (a concurrent identical
    request won the race); nothing was stored."""

    def __init__(self, turn_id: int) -> None:
        super().__init__(f"key already names turn {turn_id}")
        self.turn_id = turn_id


IDEMPOTENCY_DONE = "idem:"
"""Index key prefix: Idempotency-Key -> the first turn of the stored reply (set by the
append that stores that reply)."""
IDEMPOTENCY_PENDING = "idp:"
"""Index key prefix: Idempotency-Key -> `since|owner|fingerprint` while a request holding
the key generates (`claim_idempotency`)."""


@dataclass(slots=True, frozen=True)
class IdempotencyClaim:
    """What `claim_idempotency` found for a key."""

    state: str
    """owned (the caller holds the key now) | pending (another request does) | done."""
    turn_id: int = 0
    """done: the first turn of the stored reply."""
    fingerprint: str = ""
    """pending: the body fingerprint of the request holding the key."""


ABORTS_KEPT_S = 3600.0
"""How long a store keeps an abort (`record_abort`): a server that cannot read the store for
longer than this may miss one."""


class StoreUnavailable(RuntimeError):
    """The store cannot be reached now (down, restarting, loading its data, failing over).
    Transient: the caller answers 503 with `retry_after_s`. An operation that raised it may
    still have taken effect only where the store says so (RedisStore's appends are
    idempotent across its own retries, so a turn is never stored twice)."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionStore(Protocol):
    """Storage of sessions and their turn trees. All methods are atomic per call.

    Every method that reads or writes a session's turns (lookup, append_turns, resolve_key,
    all_turns, get_turns, counters) raises SessionNotFound when the session does not exist
    or has expired. Records come back as stored: logprobs as float32 values, `extra` after
    a JSON round trip, `turn_id` set. The TTL slides: it counts from the session's creation
    or last append; reads do not extend it. Any method may raise StoreUnavailable when the
    store cannot be reached (a networked store, after its own bounded retries).
    """

    async def create_session(self, meta: SessionMeta) -> SessionMeta:
        """Create with a fresh incarnation token (`new_incarnation`); raises SessionExists
        if the id is taken."""
        ...

    async def get_session(self, session_id: str) -> SessionMeta | None: ...

    async def delete_session(self, session_id: str) -> bool:
        """Remove the session and all its turns; False if it did not exist."""
        ...

    async def put_images(self, session_id: str, images: dict[str, bytes]) -> None:
        """Keep the session's images, once per content hash (SHA-256 hex); they live and
        expire with the session. SessionNotFound if it does not exist."""
        ...

    async def get_image(self, session_id: str, sha256: str) -> bytes | None: ...

    async def get_images(self, session_id: str, sha256s: list[str]) -> dict[str, bytes]:
        """The session's images among `sha256s` that are still kept (one round trip): a turn
        continued without its earlier images being resent is sent them from here."""
        ...

    async def lookup(
        self,
        session_id: str,
        reply_keys: list[str],
        input_key: str | None,
        *,
        known: RecordCache | None = None,
    ) -> LookupResult:
        """One round trip: the deepest (highest-index) reply key that is stored, with its
        whole root-to-turn path, and the turn stored under `input_key`, with its parent's
        path. Raises SessionNotFound if the session does not exist (leaving `known` as it
        was).

        With `known`, checked atomically with the lookup: if `known.incarnation` is the
        session's, every record on the paths whose id is in `known.records` is that cached
        object, neither transferred nor decoded again, and the records that were decoded are
        added to `known.records`. Otherwise `known.records` is ignored (everything is
        fetched) and replaced by what was decoded, and `known.incarnation` becomes the
        session's (`RecordCache.learn`). The result is the same either way, but for the
        identity of the record objects."""
        ...

    async def append_turns(
        self,
        session_id: str,
        turns: list[TurnRecord],
        keys: list[list[str]],
        *,
        unless_key: str | None = None,
        incarnation: str | None = None,
    ) -> list[int]:
        """Atomically store `turns` (the sibling choices of one request), allocate their
        ids, index turn `i` under every key in `keys[i]` (reply key, input key, response
        id...; a key already stored keeps its first turn, but for `IDEMPOTENCY_DONE` keys,
        which replace a pending claim), refresh the session's TTL and update its counters.
        Returns the allocated ids in order. Either everything is stored or nothing is.
        Raises SessionNotFound if the session is gone (or, with `incarnation`, if the session
        is not that incarnation any more: deleted and created again since it was read),
        SessionFinished if it is finished, UnknownParent if a turn's parent_id
        is not in the session, KeyTaken if `unless_key` is already stored (checked in the
        same atomic step: two identical requests never both store a root), ValueError on
        malformed turns (no turns, a key list per turn missing, token IDs outside
        [0, 2**32), logprobs not one per completion token). The `turn_id` of the records
        passed in is ignored and left unchanged."""
        ...

    async def claim_idempotency(
        self, session_id: str, key: str, fingerprint: str, *, owner: str, stale_after_s: float
    ) -> IdempotencyClaim:
        """Atomically: `done` if a reply is stored under the Idempotency-Key `key`; else
        `pending` if another owner claimed it less than `stale_after_s` ago; else claim it
        for `owner` (`owned`; a claim by the same owner is owned again). The claim lives
        with the session (same TTL, deleted with it). Raises SessionNotFound."""
        ...

    async def release_idempotency(self, session_id: str, key: str, owner: str) -> None:
        """Drop `owner`'s pending claim of `key` (its request failed and stored nothing);
        a claim of another owner or a stored reply stays. No error if the session is gone."""
        ...

    async def record_abort(self, session_id: str, at: float) -> None:
        """Record that the session's generations that started at or before `at` (Unix time)
        are to be cut, on whichever server runs them: each server generating watches
        `aborts_since`. Kept ABORTS_KEPT_S, in a shared store replicated like a turn
        (`wait_replicas`); not checked against the session (the caller did)."""
        ...

    async def aborts_since(self, since: float) -> dict[str, float]:
        """Session id -> the time of its latest abort, for aborts recorded at or after
        `since` (one round trip, whatever the number of sessions)."""
        ...

    async def resolve_key(self, session_id: str, key: str) -> int | None:
        """The turn id stored under `key` (e.g. a Responses API response id), if any."""
        ...

    async def all_turns(self, session_id: str) -> list[TurnRecord]:
        """Every turn of the session, ordered by turn id (for export and summaries)."""
        ...

    async def get_turns(self, session_id: str, turn_ids: list[int]) -> list[TurnRecord | None]: ...

    async def counters(self, session_id: str) -> SessionCounters: ...

    async def list_sessions(self) -> list[tuple[SessionMeta, SessionCounters]]:
        """Every live session with its counters, in no particular order. Costs a pass over
        all sessions (no index is written per turn): for browsing, not for the turn path."""
        ...

    async def finish_session(self, session_id: str, finish: Finish) -> None:
        """Mark the session finished (it then appears in `list_finished`), atomically with
        respect to `append_turns`: every append after it raises SessionFinished, so an export
        taken at finish is the rollout's last word. Raises SessionNotFound, or AlreadyFinished
        (changing nothing). The TTL is left as it is."""
        ...

    async def get_finish(self, session_id: str) -> Finish | None:
        """The session's finish, None while it is not finished. Raises SessionNotFound."""
        ...

    async def list_finished(
        self, *, since: float | None = None, until: float | None = None, limit: int = 1000
    ) -> list[tuple[str, SessionMeta, Finish]]:
        """Finished sessions that still exist, oldest finish first, with
        `since <= finished_at <= until`; at most `limit`."""
        ...

    async def get_policy(self) -> bytes | None:
        """The published policy (`policy/state.py` encodes it), None before any publish."""
        ...

    async def put_policy(self, document: bytes) -> None:
        """Replace the published policy (its one writer holds the `policy` lease)."""
        ...

    async def claim_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take the lease `name` for `ttl_s` seconds, or extend it if `owner` holds it; False
        while another owner holds it. Leases make one server at a time do a fleet-wide job
        (a publish, one replica's catch-up)."""
        ...

    async def release_lease(self, name: str, owner: str) -> None:
        """Give the lease back if `owner` still holds it."""
        ...

    async def ping(self) -> bool:
        """Whether the store answers now (one attempt, no retries: readiness probes)."""
        ...

    async def close(self) -> None: ...
