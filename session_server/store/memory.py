"""The embedded store: one process, no Redis (the server without `--redis-url`).

Records are kept in the same packed form the Redis store writes, so both stores return
byte-for-byte the same data (float32 logprobs, JSON round trip of `extra`). Every method runs
without yielding to the event loop, which is what makes each call atomic here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from session_server.store.base import (
    ABORTS_KEPT_S,
    IDEMPOTENCY_DONE,
    AlreadyFinished,
    Finish,
    IdempotencyClaim,
    KeyTaken,
    LookupResult,
    RecordCache,
    SessionCounters,
    SessionExists,
    SessionFinished,
    SessionMeta,
    SessionNotFound,
    TurnRecord,
    UnknownParent,
    new_incarnation,
)
from session_server.store.codec import (
    decode_finish,
    decode_meta,
    decode_turn,
    encode_append,
    encode_finish,
    encode_meta,
    validate_meta,
)


@dataclass(slots=True)
class _Session:
    meta: bytes
    incarnation: str
    ttl_seconds: int | None
    expires_at: float | None
    records: dict[int, bytes] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    children: dict[int, int] = field(default_factory=dict)
    segments: int = 0
    tokens: int = 0
    breaks: dict[str, int] = field(default_factory=dict)
    finish: bytes | None = None
    claims: dict[str, tuple[float, str, str]] = field(default_factory=dict)
    """Idempotency-Key -> (since, owner, fingerprint) while its request generates."""
    images: dict[str, bytes] = field(default_factory=dict)

    def touch(self, now: float) -> None:
        if self.ttl_seconds is not None:
            self.expires_at = now + self.ttl_seconds


class MemoryStore:
    """In-process SessionStore; expired sessions vanish on access and in periodic sweeps."""

    def __init__(
        self,
        *,
        sweep_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions: dict[str, _Session] = {}
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s
        self._next_sweep = clock() + sweep_interval_s
        self._aborts: dict[str, float] = {}
        self._policy: bytes | None = None
        self._leases: dict[str, tuple[str, float]] = {}
        """Lease name -> (owner, monotonic expiry)."""

    def _live(self, session_id: str) -> _Session | None:
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)
        session = self._sessions.get(session_id)
        if session is not None and session.expires_at is not None and now >= session.expires_at:
            del self._sessions[session_id]
            return None
        return session

    def _sweep(self, now: float) -> None:
        expired = [
            sid
            for sid, s in self._sessions.items()
            if s.expires_at is not None and now >= s.expires_at
        ]
        for sid in expired:
            del self._sessions[sid]
        self._next_sweep = now + self._sweep_interval_s

    def _require(self, session_id: str) -> _Session:
        session = self._live(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    def _path(
        self,
        session: _Session,
        turn_id: int | None,
        held: dict[int, TurnRecord],
        decoded: dict[int, TurnRecord],
    ) -> list[TurnRecord]:
        """Root-to-`turn_id` records: the caller's (`held`) where it has them, else decoded
        into `decoded`, which shares them between the paths of one lookup."""
        path: list[TurnRecord] = []
        while turn_id is not None:
            record = held.get(turn_id) or decoded.get(turn_id)
            if record is None:
                record = decoded[turn_id] = decode_turn(turn_id, session.records[turn_id])
            path.append(record)
            turn_id = record.parent_id
        path.reverse()
        return path

    async def create_session(self, meta: SessionMeta) -> SessionMeta:
        validate_meta(meta)
        if self._live(meta.session_id) is not None:
            raise SessionExists(meta.session_id)
        packed = encode_meta(meta)
        session = _Session(
            meta=packed,
            incarnation=new_incarnation(),
            ttl_seconds=meta.ttl_seconds,
            expires_at=None,
        )
        session.touch(self._clock())
        self._sessions[meta.session_id] = session
        return decode_meta(packed, session.incarnation)

    async def get_session(self, session_id: str) -> SessionMeta | None:
        session = self._live(session_id)
        return None if session is None else decode_meta(session.meta, session.incarnation)

    async def delete_session(self, session_id: str) -> bool:
        if self._live(session_id) is None:
            return False
        del self._sessions[session_id]
        return True

    async def put_images(self, session_id: str, images: dict[str, bytes]) -> None:
        session = self._live(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        for sha256, data in images.items():
            session.images.setdefault(sha256, data)

    async def get_image(self, session_id: str, sha256: str) -> bytes | None:
        session = self._live(session_id)
        return None if session is None else session.images.get(sha256)

    async def get_images(self, session_id: str, sha256s: list[str]) -> dict[str, bytes]:
        session = self._live(session_id)
        kept = {} if session is None else session.images
        return {sha: kept[sha] for sha in sha256s if sha in kept}

    async def lookup(
        self,
        session_id: str,
        reply_keys: list[str],
        input_key: str | None,
        *,
        known: RecordCache | None = None,
    ) -> LookupResult:
        session = self._require(session_id)
        held = (
            known.records if known is not None and known.incarnation == session.incarnation else {}
        )
        matched: int | None = None
        for i in range(len(reply_keys) - 1, -1, -1):
            if reply_keys[i] in session.index:
                matched = i
                break
        decoded: dict[int, TurnRecord] = {}
        parent_path = (
            self._path(session, session.index[reply_keys[matched]], held, decoded)
            if matched is not None
            else []
        )
        retry_of: TurnRecord | None = None
        retry_path: list[TurnRecord] = []
        retry_id = session.index.get(input_key) if input_key is not None else None
        if retry_id is not None:
            retry_path = self._path(session, retry_id, held, decoded)
            retry_of = retry_path.pop()
        if known is not None:
            known.learn(session.incarnation, decoded)
        return LookupResult(
            parent_path=parent_path,
            matched_key_index=matched,
            retry_of=retry_of,
            retry_path=retry_path,
            turn_count=len(session.records),
            parent_children=session.children.get(parent_path[-1].turn_id, 0) if parent_path else 0,
            incarnation=session.incarnation,
            finished=session.finish is not None,
        )

    async def append_turns(
        self,
        session_id: str,
        turns: list[TurnRecord],
        keys: list[list[str]],
        *,
        unless_key: str | None = None,
        incarnation: str | None = None,
    ) -> list[int]:
        batch = encode_append(turns, keys)
        session = self._require(session_id)
        if incarnation is not None and incarnation != session.incarnation:
            raise SessionNotFound(session_id)
        if session.finish is not None:
            raise SessionFinished(session_id)
        for parent in batch.parents:
            if parent and parent not in session.records:
                raise UnknownParent(f"session {session_id} has no turn {parent}")
        if unless_key is not None and unless_key in session.index:
            raise KeyTaken(session.index[unless_key])
        first = len(session.records) + 1
        ids = list(range(first, first + len(batch.blobs)))
        for turn_id, blob, turn_keys, parent in zip(
            ids, batch.blobs, batch.keys, batch.parents, strict=True
        ):
            session.records[turn_id] = blob
            if parent:
                session.children[parent] = session.children.get(parent, 0) + 1
            for key in turn_keys:
                if key.startswith(IDEMPOTENCY_DONE):
                    session.claims.pop(key[len(IDEMPOTENCY_DONE) :], None)
                session.index.setdefault(key, turn_id)
        session.segments += batch.segments
        session.tokens += batch.tokens
        for reason in batch.breaks:
            session.breaks[reason] = session.breaks.get(reason, 0) + 1
        session.touch(self._clock())
        return ids

    async def resolve_key(self, session_id: str, key: str) -> int | None:
        return self._require(session_id).index.get(key)

    async def claim_idempotency(
        self, session_id: str, key: str, fingerprint: str, *, owner: str, stale_after_s: float
    ) -> IdempotencyClaim:
        session = self._require(session_id)
        done = session.index.get(IDEMPOTENCY_DONE + key)
        if done is not None:
            return IdempotencyClaim("done", turn_id=done)
        now = self._clock()
        claim = session.claims.get(key)
        if claim is not None and claim[1] != owner and now - claim[0] < stale_after_s:
            return IdempotencyClaim("pending", fingerprint=claim[2])
        session.claims[key] = (now, owner, fingerprint)
        return IdempotencyClaim("owned")

    async def release_idempotency(self, session_id: str, key: str, owner: str) -> None:
        session = self._live(session_id)
        if session is not None and key in session.claims and session.claims[key][1] == owner:
            del session.claims[key]

    async def record_abort(self, session_id: str, at: float) -> None:
        self._aborts[session_id] = max(at, self._aborts.get(session_id, at))
        horizon = time.time() - ABORTS_KEPT_S
        self._aborts = {sid: t for sid, t in self._aborts.items() if t >= horizon}

    async def aborts_since(self, since: float) -> dict[str, float]:
        return {sid: at for sid, at in self._aborts.items() if at >= since}

    async def get_policy(self) -> bytes | None:
        return self._policy

    async def put_policy(self, document: bytes) -> None:
        self._policy = document

    async def claim_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        now = time.monotonic()
        holder = self._leases.get(name)
        if holder is not None and holder[0] != owner and holder[1] > now:
            return False
        self._leases[name] = (owner, now + ttl_s)
        return True

    async def release_lease(self, name: str, owner: str) -> None:
        if (holder := self._leases.get(name)) is not None and holder[0] == owner:
            del self._leases[name]

    async def all_turns(self, session_id: str) -> list[TurnRecord]:
        session = self._require(session_id)
        return [decode_turn(i, session.records[i]) for i in sorted(session.records)]

    async def get_turns(self, session_id: str, turn_ids: list[int]) -> list[TurnRecord | None]:
        session = self._require(session_id)
        return [
            decode_turn(i, session.records[i]) if i in session.records else None for i in turn_ids
        ]

    async def counters(self, session_id: str) -> SessionCounters:
        session = self._require(session_id)
        return SessionCounters(
            turns=len(session.records),
            segments=session.segments,
            breaks=dict(session.breaks),
            tokens=session.tokens,
        )

    async def list_sessions(self) -> list[tuple[SessionMeta, SessionCounters]]:
        self._sweep(self._clock())
        return [
            (decode_meta(session.meta), await self.counters(sid))
            for sid, session in self._sessions.items()
        ]

    async def finish_session(self, session_id: str, finish: Finish) -> None:
        packed = encode_finish(finish)
        session = self._require(session_id)
        if session.finish is not None:
            raise AlreadyFinished(session_id)
        session.finish = packed

    async def get_finish(self, session_id: str) -> Finish | None:
        packed = self._require(session_id).finish
        return None if packed is None else decode_finish(packed)

    async def list_finished(
        self, *, since: float | None = None, until: float | None = None, limit: int = 1000
    ) -> list[tuple[str, SessionMeta, Finish]]:
        self._sweep(self._clock())
        found = [
            (sid, decode_meta(s.meta), decode_finish(s.finish))
            for sid, s in self._sessions.items()
            if s.finish is not None
        ]
        found = [
            item
            for item in found
            if (since is None or item[2].finished_at >= since)
            and (until is None or item[2].finished_at <= until)
        ]
        found.sort(key=lambda item: item[2].finished_at)
        return found[:limit]

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._sessions.clear()
