"""The Redis store: sessions shared by any number of server replicas.

A session is four keys, hash-tagged on the session id so that they share one Cluster slot
and every script may touch all of them:
- `{prefix}:{<sid>}:meta`    hash: `meta` (packed SessionMeta), `inc` (incarnation token),
                             `ttl_ms`, and the counters
                             `turns` (also the id allocator), `segments`, `tokens`,
                             `b:<break_reason>`;
- `{prefix}:{<sid>}:turns`   hash: turn id -> packed record (codec.py; the parent id is in it);
- `{prefix}:{<sid>}:index`   hash: lookup key -> turn id (first writer wins);
- `{prefix}:{<sid>}:parents` hash: turn id -> parent id (0 = root), so that the lookup script
                             walks a path without copying the records the caller holds.
A finished session also has `fin` (packed Finish) in its meta hash and is a member of the
sorted set `{prefix}:finished` (score: finish time), the one key shared by all sessions: it is
only ever used by single-key commands, so it may live in any Cluster slot.
Lookups and appends are Lua scripts (EVALSHA), so each is one round trip and atomic.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Collection
from importlib.resources import files
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from session_server.store.base import (
    AlreadyFinished,
    Finish,
    LookupResult,
    RecordCache,
    SessionCounters,
    SessionExists,
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


def _script(name: str) -> str:
    return files("session_server.store").joinpath(name).read_text()


def _id_bitmap(turn_ids: Collection[int]) -> bytes:
    """The ids as the lookup script reads them: bit `id % 8` of byte `id // 8` set. A few
    bytes per hundred turns, and the script tests an id without building a set."""
    if not turn_ids:
        return b""
    ids = np.fromiter(turn_ids, dtype=np.int64, count=len(turn_ids))
    bits = np.zeros(int(ids.max()) + 1, dtype=bool)
    bits[ids] = True
    return np.packbits(bits, bitorder="little").tobytes()


class RedisStore:
    """SessionStore on Redis (redis-py asyncio; hiredis parses replies when installed)."""

    def __init__(self, url: str, *, key_prefix: str = "tk") -> None:
        self._redis = aioredis.Redis.from_url(url, decode_responses=False)
        self._prefix = key_prefix
        self._lookup = self._redis.register_script(_script("lookup.lua"))
        self._append = self._redis.register_script(_script("append.lua"))
        self._create = self._redis.register_script(_script("create.lua"))
        self._delete = self._redis.register_script(_script("delete.lua"))
        self._finish = self._redis.register_script(_script("finish.lua"))
        self._finished_key = f"{key_prefix}:finished"

    def session_keys(self, session_id: str) -> list[str]:
        """Every key the session occupies: meta, turns, index, parents (in that order)."""
        base = f"{self._prefix}:{{{session_id}}}"
        return [f"{base}:meta", f"{base}:turns", f"{base}:index", f"{base}:parents"]

    async def create_session(self, meta: SessionMeta) -> SessionMeta:
        validate_meta(meta)
        packed = encode_meta(meta)
        ttl_ms = "" if meta.ttl_seconds is None else str(round(meta.ttl_seconds * 1000))
        created = await self._create(
            keys=self.session_keys(meta.session_id), args=[packed, ttl_ms, new_incarnation()]
        )
        if not created:
            raise SessionExists(meta.session_id)
        return decode_meta(packed)

    async def get_session(self, session_id: str) -> SessionMeta | None:
        packed = await self._redis.hget(self.session_keys(session_id)[0], "meta")
        return None if packed is None else decode_meta(packed)

    async def delete_session(self, session_id: str) -> bool:
        deleted = bool(await self._delete(keys=self.session_keys(session_id)))
        await self._redis.zrem(self._finished_key, session_id)
        return deleted

    async def lookup(
        self,
        session_id: str,
        reply_keys: list[str],
        input_key: str | None,
        *,
        known: RecordCache | None = None,
    ) -> LookupResult:
        # What was announced to the script, read before the await: a concurrent lookup may
        # give `known` a new incarnation and records dict meanwhile (RecordCache.learn).
        announced = known.incarnation if known is not None else None
        held = known.records if known is not None and announced is not None else {}
        encoded = [key.encode() for key in reply_keys]
        key_ends = struct.pack(f"<{len(encoded)}I", *itertools.accumulate(map(len, encoded)))
        args: list[bytes | str] = [
            announced or "",
            _id_bitmap(held.keys()),
            key_ends,
            b"".join(encoded),
        ]
        if input_key is not None:
            args.append(input_key)
        reply = await self._lookup(keys=self.session_keys(session_id), args=args)
        if reply is None:
            raise SessionNotFound(session_id)

        turn_count, matched, children, n_path = reply[0], reply[2], reply[3], reply[4]
        incarnation = reply[1].decode() or None
        pos = 5
        path_ids = reply[pos : pos + n_path]
        pos += n_path
        retry_id, n_retry = reply[pos], reply[pos + 1]
        pos += 2
        retry_ids = reply[pos : pos + n_retry]
        pos += n_retry
        flat = reply[pos:]
        decoded = {
            turn_id: decode_turn(turn_id, blob)
            for turn_id, blob in zip(flat[0::2], flat[1::2], strict=True)
        }
        # The script sent every record unless it honoured the incarnation announced.
        if announced is None or incarnation != announced:
            held = {}
        if known is not None:
            known.learn(incarnation, decoded)

        def record(turn_id: int) -> TurnRecord:
            return held.get(turn_id) or decoded[turn_id]

        retry_path = [record(i) for i in retry_ids]
        retry_of = retry_path.pop() if retry_id else None
        return LookupResult(
            parent_path=[record(i) for i in path_ids],
            matched_key_index=matched - 1 if matched else None,
            retry_of=retry_of,
            retry_path=retry_path,
            turn_count=turn_count,
            parent_children=children,
            incarnation=incarnation,
        )

    async def append_turns(
        self, session_id: str, turns: list[TurnRecord], keys: list[list[str]]
    ) -> list[int]:
        batch = encode_append(turns, keys)
        args: list[bytes | str | int] = [
            len(batch.blobs),
            batch.segments,
            batch.tokens,
            len(batch.breaks),
            *batch.breaks,
        ]
        for parent, blob, turn_keys in zip(batch.parents, batch.blobs, batch.keys, strict=True):
            args += [parent, blob, len(turn_keys), *turn_keys]
        reply = await self._append(keys=self.session_keys(session_id), args=args)
        status = reply[0]
        if status == b"gone":
            raise SessionNotFound(session_id)
        if status == b"parent":
            raise UnknownParent(f"session {session_id} has no turn {int(reply[1])}")
        first = int(reply[1])
        return list(range(first, first + len(batch.blobs)))

    async def _read(self, session_id: str, key: str, command: str, *args: str | int) -> Any:
        """Run one read command on a session key, raising SessionNotFound if the session is
        gone; one round trip (MULTI/EXEC) so the existence check and the read agree."""
        meta_key = self.session_keys(session_id)[0]
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(meta_key)
            pipe.execute_command(command, key, *args)
            exists, result = await pipe.execute()
        if not exists:
            raise SessionNotFound(session_id)
        return result

    async def resolve_key(self, session_id: str, key: str) -> int | None:
        index_key = self.session_keys(session_id)[2]
        turn_id = await self._read(session_id, index_key, "HGET", key)
        return None if turn_id is None else int(turn_id)

    async def all_turns(self, session_id: str) -> list[TurnRecord]:
        turns_key = self.session_keys(session_id)[1]
        raw: dict[bytes, bytes] = await self._read(session_id, turns_key, "HGETALL")
        records = (decode_turn(int(turn_id), blob) for turn_id, blob in raw.items())
        return sorted(records, key=lambda r: r.turn_id)

    async def get_turns(self, session_id: str, turn_ids: list[int]) -> list[TurnRecord | None]:
        if not turn_ids:
            await self._read(session_id, self.session_keys(session_id)[0], "EXISTS")
            return []
        turns_key = self.session_keys(session_id)[1]
        blobs: list[bytes | None] = await self._read(session_id, turns_key, "HMGET", *turn_ids)
        return [
            None if blob is None else decode_turn(turn_id, blob)
            for turn_id, blob in zip(turn_ids, blobs, strict=True)
        ]

    async def counters(self, session_id: str) -> SessionCounters:
        fields = await self._redis.hgetall(self.session_keys(session_id)[0])
        if not fields:
            raise SessionNotFound(session_id)
        return SessionCounters(
            turns=int(fields[b"turns"]),
            segments=int(fields[b"segments"]),
            breaks={
                name[2:].decode(): int(count)
                for name, count in fields.items()
                if name.startswith(b"b:")
            },
            tokens=int(fields[b"tokens"]),
        )

    async def finish_session(self, session_id: str, finish: Finish) -> None:
        packed = encode_finish(finish)
        # Indexed first: a member whose session holds no `fin` (the script below failed or
        # said no) is skipped by list_finished, while a finish missing from the index
        # would never be listed.
        await self._redis.zadd(self._finished_key, {session_id: finish.finished_at}, nx=True)
        status = await self._finish(keys=self.session_keys(session_id)[:1], args=[packed])
        if status == b"gone":
            await self._redis.zrem(self._finished_key, session_id)
            raise SessionNotFound(session_id)
        if status == b"done":
            raise AlreadyFinished(session_id)

    async def get_finish(self, session_id: str) -> Finish | None:
        meta_key = self.session_keys(session_id)[0]
        packed = await self._read(session_id, meta_key, "HGET", "fin")
        return None if packed is None else decode_finish(packed)

    async def list_finished(
        self, *, since: float | None = None, until: float | None = None, limit: int = 1000
    ) -> list[tuple[str, SessionMeta, Finish]]:
        members = await self._redis.zrangebyscore(
            self._finished_key,
            "-inf" if since is None else since,
            "+inf" if until is None else until,
            start=0,
            num=limit,
        )
        if not members:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for member in members:
                pipe.hmget(self.session_keys(member.decode())[0], "meta", "fin")
            rows = await pipe.execute()
        found: list[tuple[str, SessionMeta, Finish]] = []
        gone: list[bytes] = []
        for member, (meta, fin) in zip(members, rows, strict=True):
            if meta is None:
                gone.append(member)  # expired: its index entry goes too
            elif fin is not None:
                found.append((member.decode(), decode_meta(meta), decode_finish(fin)))
        if gone:
            await self._redis.zrem(self._finished_key, *gone)
        return found

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._redis.aclose()
