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
A session with images also has `{prefix}:{<sid>}:images` (hash: SHA-256 hex -> image bytes),
written by `images.lua`, which gives it the meta key's remaining time to live on each write.
A finished session also has `fin` (packed Finish) in its meta hash and is a member of the
sorted set `{prefix}:finished` (score: finish time), the one key shared by all sessions: it is
only ever used by single-key commands, so it may live in any Cluster slot. Aborts are the
sorted set `{prefix}:aborts` (session id -> abort time, the last ABORTS_KEPT_S): every server
generating reads it with one command per poll, whatever the number of sessions.
Lookups and appends are Lua scripts (EVALSHA), so each is one round trip and atomic.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import struct
import time
from collections.abc import Awaitable, Callable, Collection
from importlib.resources import files
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from session_server.store.base import (
    ABORTS_KEPT_S,
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
    StoreUnavailable,
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

log = logging.getLogger("tokenkeep.store")
T = TypeVar("T")


# Faults that pass: Redis down or restarting (ConnectionError, BusyLoadingError is one),
# slow (TimeoutError), a Sentinel failover in progress (ReadOnlyError from the old master,
# MasterNotFoundError is a ConnectionError), a Cluster resharding or failing over
# (TryAgain, ClusterDown/MasterDown). Memory full (OOM) is refused at once (`_call`).
# Anything else is a bug and stays loud.
class _ReplicasBehind(Exception):
    """WAIT saw fewer replicas than asked for (one is resyncing, or down)."""


class _Rerouted(Exception):
    """A Cluster write (with WAIT) reached a node that no longer serves the slot, or one that
    lacks the script (a replica promoted since): sent again once the client caught up."""


FULL_RETRY_AFTER_S = 5
"""Retry-After of a turn refused because Redis is full."""

_TRANSIENT = (
    _ReplicasBehind,
    _Rerouted,
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    TryAgainError,
    ClusterDownError,
    RedisClusterException,
    OSError,
    TimeoutError,
)


def _cut_under_us(exc: Exception) -> bool:
    """A command whose connection redis-py closed while it was being sent: during a Cluster
    failover, another command's fault makes it re-read the slot map and drop connections,
    in use or not (redis-py 8.1: seen on turns' EVALSHA+WAIT and HGET, 500s before). Nothing
    reached Redis on that connection, or a resend is safe (see RedisStore): transient."""
    return (isinstance(exc, AttributeError) and "writelines" in str(exc)) or (
        isinstance(exc, RuntimeError) and "handler is closed" in str(exc)
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


def _hosts(netloc: str) -> list[tuple[str, int]]:
    hosts = []
    for part in netloc.rpartition("@")[2].split(","):
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        hosts.append((host.strip("[]") or "127.0.0.1", int(port or 6379)))
    return hosts


def connect(url: str, *, timeout_s: float = 5.0, password: str | None = None) -> Any:
    """A redis-py asyncio client for `url`:
    - `redis://`, `rediss://` (TLS), `unix://`: one Redis server (redis-py's URL syntax);
    - `redis+sentinel://[:password@]host:port[,host:port...]/<master name>[/db]`
      (`rediss+sentinel://`: TLS to the data nodes; `?sentinel_password=` if the sentinels
      ask for one): the master that the sentinels name, followed across failovers;
    - `redis+cluster://[:password@]host:port[,host:port...]` (`rediss+cluster://`): a Redis
      Cluster, any of its nodes to start from.
    `password` is used where the URL carries none (TOKENKEEP_REDIS_PASSWORD).
    Commands are not retried by the client: RedisStore retries with its own backoff (it knows
    which operations are safe to send twice)."""
    parts = urlsplit(url)
    scheme, _, topology = parts.scheme.partition("+")
    options: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": min(1.0, timeout_s),
        "password": unquote(parts.password) if parts.password else password,
        "username": unquote(parts.username) if parts.username else None,
    }
    if scheme == "rediss":
        options["ssl"] = True
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if topology == "sentinel":
        service, _, db = parts.path.strip("/").partition("/")
        if not service:
            raise ValueError(f"{url}: name the master, redis+sentinel://host:port/<name>")
        sentinel = Sentinel(
            _hosts(parts.netloc),
            sentinel_kwargs={
                "socket_timeout": min(1.0, timeout_s),
                "socket_connect_timeout": min(1.0, timeout_s),
                "password": query.get("sentinel_password"),
            },
            retry=Retry(NoBackoff(), 0),
            **options,
        )
        return sentinel.master_for(service, db=int(db or 0))
    if topology == "cluster":
        nodes = [ClusterNode(host, port) for host, port in _hosts(parts.netloc)]
        return RedisCluster(startup_nodes=nodes, **options)
    if topology:
        raise ValueError(f"{url}: unknown Redis URL scheme {parts.scheme!r}")
    # from_url reads the URL's own credentials; a password given apart fills in for none.
    extra = {} if parts.password or password is None else {"password": password}
    return aioredis.Redis.from_url(
        url,
        retry=Retry(NoBackoff(), 0),
        **extra,
        **{k: v for k, v in options.items() if k not in ("password", "username", "ssl")},
    )


class RedisStore:
    """SessionStore on Redis (redis-py asyncio; hiredis parses replies when installed).

    Redis may go away (killed, restarted, loading its data, failing over): every operation
    is retried with exponential backoff for up to `retry_s`, then raises StoreUnavailable.
    Reconnection is the client's: the next command after a failure dials again. Appends are
    retried too, safely: each carries a random token that the script remembers with the
    session, so an append whose reply was lost returns the turns it stored.
    `wait_replicas` > 0 acknowledges a creation or an append only after that many replicas
    have it (Redis WAIT), else StoreUnavailable (the write may then be on the primary only)."""

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        key_prefix: str = "tk",
        timeout_s: float = 5.0,
        retry_s: float = 2.0,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self._redis = connect(url, timeout_s=timeout_s, password=password)
        # The recorded aborts are polled on connections of their own: the poll goes on while
        # a Cluster fails over, and redis-py's reconnection after a fault there would cut the
        # connections of concurrent turns (RuntimeError/AttributeError 500s, seen).
        self._poll = connect(url, timeout_s=timeout_s, password=password)
        self._prefix = key_prefix
        self._retry_s = retry_s
        self._wait_replicas = wait_replicas
        self._wait_timeout_ms = wait_timeout_ms
        self._down_since: float | None = None
        self.full_refusals = 0
        """Writes Redis refused because its memory is full (maxmemory, noeviction)."""
        self._lookup = self._redis.register_script(_script("lookup.lua"))
        self._append = self._redis.register_script(_script("append.lua"))
        self._create = self._redis.register_script(_script("create.lua"))
        self._delete = self._redis.register_script(_script("delete.lua"))
        self._read_script = self._redis.register_script(_script("read.lua"))
        self._finish = self._redis.register_script(_script("finish.lua"))
        self._claim = self._redis.register_script(_script("claim.lua"))
        self._release = self._redis.register_script(_script("release.lua"))
        self._images = self._redis.register_script(_script("images.lua"))
        self._abort = self._redis.register_script(_script("abort.lua"))
        self._lease = self._redis.register_script(_script("lease.lua"))
        self._unlease = self._redis.register_script(_script("unlease.lua"))
        self._finished_key = f"{key_prefix}:finished"
        self._aborts_key = f"{key_prefix}:aborts"
        self._policy_key = f"{key_prefix}:policy"

    async def _call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run `operation`, retrying transient faults with backoff within `retry_s`."""
        deadline = time.monotonic() + self._retry_s
        delay = 0.05
        while True:
            try:
                result = await operation()
            except OutOfMemoryError as exc:
                # maxmemory reached with noeviction: nothing was written (a script is refused
                # at its first write) and nothing frees memory within a retry window. The
                # turn is refused at once, everything acknowledged before stays.
                self.full_refusals += 1
                log.warning(json.dumps({"event": "store_full", "reason": _reason(exc)}))
                raise StoreUnavailable(
                    "session store full (Redis maxmemory reached); nothing was stored: retry "
                    "later, or finish, export and delete sessions to free memory",
                    retry_after_s=FULL_RETRY_AFTER_S,
                ) from None
            except Exception as exc:
                if not isinstance(exc, _TRANSIENT) and not _cut_under_us(exc):
                    raise
                self._went_down(exc)
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailable(f"session store unavailable: {_reason(exc)}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            self._came_back()
            return result

    def _went_down(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(json.dumps({"event": "store_unavailable", "reason": _reason(exc)}))

    def _came_back(self) -> None:
        if self._down_since is not None:
            down_s = round(time.monotonic() - self._down_since, 3)
            self._down_since = None
            log.warning(json.dumps({"event": "store_available", "down_s": down_s}))

    def session_keys(self, session_id: str) -> list[str]:
        """Every key the session occupies: meta, turns, index, parents (in that order)."""
        base = f"{self._prefix}:{{{session_id}}}"
        return [f"{base}:meta", f"{base}:turns", f"{base}:index", f"{base}:parents"]

    async def create_session(self, meta: SessionMeta) -> SessionMeta:
        validate_meta(meta)
        packed = encode_meta(meta)
        ttl_ms = "" if meta.ttl_seconds is None else str(round(meta.ttl_seconds * 1000))
        keys, args = self.session_keys(meta.session_id), [packed, ttl_ms, new_incarnation()]
        # Retried safely: the script knows its own incarnation token.
        created = await self._call(lambda: self._write(self._create, keys, args))
        if not created:
            raise SessionExists(meta.session_id)
        return decode_meta(packed, args[2])

    async def get_session(self, session_id: str) -> SessionMeta | None:
        meta_key = self.session_keys(session_id)[0]
        packed, incarnation = await self._call(lambda: self._redis.hmget(meta_key, ["meta", "inc"]))
        if packed is None:
            return None
        return decode_meta(packed, incarnation.decode() if incarnation else None)

    async def delete_session(self, session_id: str) -> bool:
        keys = [*self.session_keys(session_id), self._images_key(session_id)]
        deleted = bool(await self._call(lambda: self._delete(keys=keys)))
        await self._call(lambda: self._redis.zrem(self._finished_key, session_id))
        return deleted

    def _images_key(self, session_id: str) -> str:
        return f"{self._prefix}:{{{session_id}}}:images"

    async def put_images(self, session_id: str, images: dict[str, bytes]) -> None:
        keys = [self.session_keys(session_id)[0], self._images_key(session_id)]
        args = [value for pair in images.items() for value in pair]
        stored = await self._call(lambda: self._write(self._images, keys, args))
        if not stored:
            raise SessionNotFound(session_id)

    async def get_image(self, session_id: str, sha256: str) -> bytes | None:
        key = self._images_key(session_id)
        data = await self._call(lambda: self._redis.hget(key, sha256))
        return None if data is None else bytes(data)

    async def get_images(self, session_id: str, sha256s: list[str]) -> dict[str, bytes]:
        if not sha256s:
            return {}
        key = self._images_key(session_id)
        found = await self._call(lambda: self._redis.hmget(key, sha256s))
        return {sha: bytes(data) for sha, data in zip(sha256s, found, strict=True) if data}

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
        keys = self.session_keys(session_id)
        reply = await self._call(lambda: self._lookup(keys=keys, args=args))
        if reply is None:
            raise SessionNotFound(session_id)

        turn_count, finished, matched, children, n_path = reply[0], *reply[2:6]
        incarnation = reply[1].decode() or None
        pos = 6
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
            finished=bool(finished),
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
        args: list[bytes | str | int] = [
            secrets.token_hex(8),
            incarnation or "",
            len(batch.blobs),
            batch.segments,
            batch.tokens,
            len(batch.breaks),
            *batch.breaks,
        ]
        for parent, blob, turn_keys in zip(batch.parents, batch.blobs, batch.keys, strict=True):
            args += [parent, blob, len(turn_keys), *turn_keys]
        if unless_key is not None:
            args.append(unless_key)
        keys = self.session_keys(session_id)
        reply = await self._call(lambda: self._write(self._append, keys, args))
        status = reply[0]
        if status == b"gone":
            raise SessionNotFound(session_id)
        if status == b"finished":
            raise SessionFinished(session_id)
        if status == b"taken":
            raise KeyTaken(int(reply[1]))
        if status == b"parent":
            raise UnknownParent(f"session {session_id} has no turn {int(reply[1])}")
        first = int(reply[1])
        return list(range(first, first + len(batch.blobs)))

    async def _write(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a write script; with `wait_replicas`, followed by WAIT on the same connection
        (WAIT covers its own connection's writes). The two are retried together: after a
        failover the script runs again on the new primary (appends are idempotent by token,
        creations by incarnation token), so WAIT never vouches for a write the new primary lacks."""
        if not self._wait_replicas:
            return await script(keys=keys, args=args)
        if isinstance(self._redis, RedisCluster):
            reply, acked = await self._write_on_slot_primary(script, keys, args)
        else:
            async with self._redis.pipeline(transaction=False) as pipe:
                await script(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", self._wait_replicas, self._wait_timeout_ms)
                reply, acked = await pipe.execute()
        if int(acked) < self._wait_replicas:
            raise _ReplicasBehind(
                f"stored on the primary but {acked} of {self._wait_replicas} replicas "
                f"confirmed it within {self._wait_timeout_ms} ms"
            )
        return reply

    async def _write_on_slot_primary(
        self, script: Any, keys: list[str], args: list[Any]
    ) -> tuple[Any, Any]:
        """EVALSHA + WAIT pipelined on one connection to the primary of the session's slot.
        Not through redis-py's ClusterPipeline: it routes a keyless WAIT to every primary
        (summing their counts), and when it re-sends a pipeline after a connection error it has
        dropped the `target_nodes` that pinned WAIT, so a count could come from a node that
        never saw the write. Here nothing is re-sent by the client: a fault marks the slot map
        stale and RedisStore._call sends both again, to whichever node holds the slot then."""
        await self._redis.initialize()  # no-op unless a fault marked the slot map stale
        node = self._redis.get_node_from_key(keys[0])
        commands = [
            PipelineCommand(0, "EVALSHA", script.sha, len(keys), *keys, *args),
            PipelineCommand(1, "WAIT", self._wait_replicas, self._wait_timeout_ms),
        ]
        try:
            await node.execute_pipeline(commands)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            # The next attempt goes where the slot map read now says (redis-py's aclose()
            # would also cut the connections of concurrent commands).
            await self._redis.nodes_manager.initialize()
            raise
        reply, acked = commands[0].result, commands[1].result
        if isinstance(reply, NoScriptError):
            await self._redis.script_load(script.script)  # on every primary
            raise _Rerouted(f"script not loaded on {node.name}")
        for result in (reply, acked):
            if isinstance(result, AskError | ClusterDownError | TryAgainError | OSError
                          | RedisConnectionError | RedisTimeoutError | ReadOnlyError):  # fmt: skip
                await self._redis.nodes_manager.initialize()
                raise _Rerouted(f"{node.name}: {_reason(result)}")
            if isinstance(result, Exception):
                raise result
        return reply, acked

    async def _read(self, session_id: str, key: str, command: str, *args: str | int) -> Any:
        """Run one read command on a session key, raising SessionNotFound if the session is
        gone; one script (a single slot, one round trip) so the existence check and the read
        agree."""
        keys = [self.session_keys(session_id)[0], key]
        reply = await self._call(lambda: self._read_script(keys=keys, args=[command, *args]))
        if not reply:
            raise SessionNotFound(session_id)
        return reply[1]

    async def resolve_key(self, session_id: str, key: str) -> int | None:
        index_key = self.session_keys(session_id)[2]
        turn_id = await self._read(session_id, index_key, "HGET", key)
        return None if turn_id is None else int(turn_id)

    async def claim_idempotency(
        self, session_id: str, key: str, fingerprint: str, *, owner: str, stale_after_s: float
    ) -> IdempotencyClaim:
        meta_key, _, index_key, _ = self.session_keys(session_id)
        args = [key, fingerprint, owner, repr(time.time()), repr(stale_after_s)]
        # Retried safely: a claim by the same owner is owned again.
        reply = await self._call(lambda: self._write(self._claim, [meta_key, index_key], args))
        if not reply:
            raise SessionNotFound(session_id)
        state = reply[0].decode()
        if state == "done":
            return IdempotencyClaim("done", turn_id=int(reply[1]))
        if state == "pending":
            return IdempotencyClaim("pending", fingerprint=reply[1].decode())
        return IdempotencyClaim("owned")

    async def release_idempotency(self, session_id: str, key: str, owner: str) -> None:
        index_key = self.session_keys(session_id)[2]
        await self._call(lambda: self._write(self._release, [index_key], [key, owner]))

    async def record_abort(self, session_id: str, at: float) -> None:
        keys, args = [self._aborts_key], [session_id, repr(at), repr(time.time() - ABORTS_KEPT_S)]
        # Retried safely: the same abort twice is the same record.
        await self._call(lambda: self._write(self._abort, keys, args))

    async def aborts_since(self, since: float) -> dict[str, float]:
        found = await self._call(
            lambda: self._poll.zrangebyscore(self._aborts_key, repr(since), "+inf", withscores=True)
        )
        return {member.decode(): float(score) for member, score in found}

    async def get_policy(self) -> bytes | None:
        found: bytes | None = await self._call(lambda: self._redis.get(self._policy_key))
        return found

    async def put_policy(self, document: bytes) -> None:
        await self._call(lambda: self._redis.set(self._policy_key, document))

    def _lease_key(self, name: str) -> str:
        return f"{self._prefix}:lease:{name}"

    async def claim_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        keys, args = [self._lease_key(name)], [owner, max(1, int(ttl_s * 1000))]
        # Retried safely: a claim whose reply was lost finds its own owner and extends.
        return bool(await self._call(lambda: self._write(self._lease, keys, args)))

    async def release_lease(self, name: str, owner: str) -> None:
        keys = [self._lease_key(name)]
        await self._call(lambda: self._write(self._unlease, keys, [owner]))

    async def all_turns(self, session_id: str) -> list[TurnRecord]:
        turns_key = self.session_keys(session_id)[1]
        flat: list[bytes] = await self._read(session_id, turns_key, "HGETALL")
        records = (
            decode_turn(int(turn_id), blob)
            for turn_id, blob in zip(flat[0::2], flat[1::2], strict=True)
        )
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
        meta_key = self.session_keys(session_id)[0]
        fields = await self._call(lambda: self._redis.hgetall(meta_key))
        if not fields:
            raise SessionNotFound(session_id)
        return _counters(fields)

    async def list_sessions(self) -> list[tuple[SessionMeta, SessionCounters]]:
        # SCAN, not an index: nothing is written per turn for browsing's sake, and on a
        # Cluster the client scans every node.
        pattern = f"{self._prefix}:{{*}}:meta"

        async def scan() -> list[dict[bytes, bytes]]:
            keys = [key async for key in self._redis.scan_iter(match=pattern, count=1000)]
            return [await self._redis.hgetall(key) for key in keys] if keys else []

        rows = await self._call(scan)
        return [(decode_meta(f[b"meta"]), _counters(f)) for f in rows if f and b"meta" in f]

    async def finish_session(self, session_id: str, finish: Finish) -> None:
        packed = encode_finish(finish)
        # Indexed first: a member whose session holds no `fin` (the script below failed or
        # said no) is skipped by list_finished, while a finish missing from the index
        # would never be listed.
        index = self._finished_key
        await self._call(lambda: self._redis.zadd(index, {session_id: finish.finished_at}, nx=True))
        meta_key = self.session_keys(session_id)[:1]
        status = await self._call(lambda: self._finish(keys=meta_key, args=[packed]))
        if status == b"gone":
            await self._call(lambda: self._redis.zrem(index, session_id))
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
        members = await self._call(
            lambda: self._redis.zrangebyscore(
                self._finished_key,
                "-inf" if since is None else since,
                "+inf" if until is None else until,
                start=0,
                num=limit,
            )
        )
        if not members:
            return []

        async def read_all() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for member in members:
                    pipe.hmget(self.session_keys(member.decode())[0], "meta", "fin")
                return await pipe.execute()

        rows = await self._call(read_all)
        found: list[tuple[str, SessionMeta, Finish]] = []
        gone: list[bytes] = []
        for member, (meta, fin) in zip(members, rows, strict=True):
            if meta is None:
                gone.append(member)  # expired: its index entry goes too
            elif fin is not None:
                found.append((member.decode(), decode_meta(meta), decode_finish(fin)))
        if gone:
            await self._call(lambda: self._redis.zrem(self._finished_key, *gone))
        return found

    async def memory(self) -> tuple[int, int] | None:
        """(used_memory, maxmemory) in bytes from INFO memory (maxmemory 0: unbounded); None
        where Redis does not answer or hides INFO (one attempt: read on /metrics)."""
        try:
            info = await self._redis.info("memory")
        except (RedisError, RedisClusterException, OSError, TimeoutError):
            return None
        if "used_memory" not in info:  # a Cluster answers per node: summed
            nodes = [v for v in info.values() if isinstance(v, dict)]
            used = sum(int(n.get("used_memory", 0)) for n in nodes)
            return used, sum(int(n.get("maxmemory", 0)) for n in nodes)
        return int(info["used_memory"]), int(info.get("maxmemory", 0))

    async def ping(self) -> bool:
        try:
            answered = bool(await self._redis.ping())
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            self._went_down(exc)
            return False
        self._came_back()
        return answered

    async def close(self) -> None:
        await self._redis.aclose()
        await self._poll.aclose()


def _counters(fields: dict[bytes, bytes]) -> SessionCounters:
    """The counters kept in a session's meta hash (see the module docstring)."""
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


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
