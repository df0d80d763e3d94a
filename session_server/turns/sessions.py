"""Session metadata and decoded turn records this process holds, and what keeps them
honest: a session deleted, expired or created again through another server is noticed by
the next lookup (its incarnation), never served from what was cached here."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

from session_server.conversation import compile_rules
from session_server.keys import key_opens
from session_server.service_config import ServiceConfig
from session_server.store.base import (
    RecordCache,
    SessionExists,
    SessionMeta,
    SessionNotFound,
    SessionStore,
)
from session_server.turns.errors import Refused, SessionMissing

T = TypeVar("T")

# Set by the auth middleware, for a request that a session key (not the admin key, not
# protected mode) let in, to the SHA-256 digest of that key: such a request must never land
# in a session that key does not open (re-created, keyless or with a new key, through
# another server whose deletion this process's cached metadata has not seen).
session_key_request: ContextVar[str | None] = ContextVar("session_key_request", default=None)


class Recreated(Exception):
    """The session was deleted and created again behind this process's cached metadata."""


class SessionCache:
    """The sessions' metadata and decoded records this process holds (both immutable once
    stored), and the checks that keep them from outliving a delete anywhere."""

    def __init__(self, store: SessionStore, config: ServiceConfig) -> None:
        self.store = store
        self.config = config
        # Session metadata never changes after creation, so it is cached to save a round
        # trip per request; each turn's lookup compares the session's incarnation with it.
        self._sessions: dict[str, SessionMeta] = {}
        # Stored turns never change either: decoded records are kept per session so a
        # lookup transfers and decodes only turns this process has not seen. The store
        # checks the session's incarnation, so a deleted and re-created id is never served
        # from an old cache.
        self._records: OrderedDict[str, RecordCache] = OrderedDict()

    async def keyed(self, session_id: str, digest: str) -> SessionMeta | None:
        """The session's metadata if a session key with this digest opens it, else None.
        A refusal by the cached metadata is checked again against the store, which replaces
        the cache: the session may have been deleted and created again
        with a new key through another server. So a new key is never refused by a stale
        cache, and a wrong key costs one store read whether or not the session exists (its
        answer time says nothing about that). A stale cache that accepts an old key is caught
        by the turn's lookup (`_check_current`)."""
        cached = self._sessions.get(session_id)
        if cached is not None and key_opens(cached.key_hash, digest):
            return cached
        meta = await self.store.get_session(session_id)
        if meta is None:
            self._sessions.pop(session_id, None)
            return None
        self._remember(meta)
        return meta if key_opens(meta.key_hash, digest) else None

    async def get(self, session_id: str, *, create: bool | None = None) -> SessionMeta:
        cached = self._sessions.get(session_id)
        if cached is not None:
            return cached
        meta = await self.store.get_session(session_id)
        if meta is None:
            if not (self.config.create_on_first_use if create is None else create):
                raise SessionMissing(session_id)
            meta = await self.create(session_id)
        self._remember(meta)
        return meta

    async def create(
        self,
        session_id: str,
        *,
        ttl_seconds: int | None = -1,
        sampling_overrides: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        normalization: list[dict[str, Any]] | None = None,
        return_token_ids: bool | None = None,
        key_hash: str = "",
        routed_experts: bool | None = None,
        reasoning_ended: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        group: str | None = None,
        group_size: int | None = None,
    ) -> SessionMeta:
        if normalization:
            compile_rules(normalization)  # reject bad patterns before anything is stored
        meta = SessionMeta(
            session_id=session_id,
            created_at=time.time(),
            ttl_seconds=self.config.default_ttl_seconds if ttl_seconds == -1 else ttl_seconds,
            sampling_overrides=dict(sampling_overrides or {}),
            metadata=dict(metadata or {}),
            normalization=list(normalization or []),
            return_token_ids=return_token_ids,
            key_hash=key_hash,
            routed_experts=self.config.routed_experts if routed_experts is None else routed_experts,
            reasoning_ended=reasoning_ended,
            chat_template_kwargs=chat_template_kwargs or None,
            group=group,
            group_size=group_size,
        )
        try:
            created = await self.store.create_session(meta)
        except SessionExists:
            existing = await self.store.get_session(session_id)
            if existing is None:
                raise
            return existing
        self._remember(created)
        return created

    async def delete(self, session_id: str) -> bool:
        self._sessions.pop(session_id, None)
        self._records.pop(session_id, None)
        return await self.store.delete_session(session_id)

    def records(self, session_id: str) -> RecordCache:
        cache = self._records.get(session_id)
        if cache is None:
            cache = self._records[session_id] = RecordCache()
            if len(self._records) > self.config.max_sessions_cached:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(session_id)
        return cache

    def held(self, session_id: str) -> RecordCache | None:
        """The session's record cache, if any (no reordering: this may run off the loop)."""
        return self._records.get(session_id)

    def drop(self, session_id: str) -> None:
        """Forget the session's metadata (gone from the store behind it)."""
        self._sessions.pop(session_id, None)

    def _remember(self, meta: SessionMeta) -> None:
        self._sessions.pop(meta.session_id, None)
        if len(self._sessions) >= self.config.max_sessions_cached:
            self._sessions.pop(next(iter(self._sessions)))
        self._sessions[meta.session_id] = meta

    async def retry_fresh(self, session_id: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """Plan once more if the session expired or was deleted behind the cached metadata
        (then it is created again, when sessions are created on first use), or was deleted
        and created again (the plan is then made with the new session's metadata: its
        sampling overrides, its rules, and its key, which must open it)."""
        try:
            return await attempt()
        except Recreated:
            self._sessions.pop(session_id, None)
            digest = session_key_request.get()
            if digest:
                meta = await self.store.get_session(session_id)
                if meta is None or not key_opens(meta.key_hash, digest):
                    raise Refused(
                        401, "wrong or expired API key", kind="authentication_error"
                    ) from None
            return await attempt()
        except SessionNotFound:
            self.forget(session_id)
            return await attempt()

    def forget(self, session_id: str) -> None:
        """The session is gone behind this process's cached metadata (deleted or expired
        through another replica). Raises SessionNotFound unless it may be created again on
        first use: never for a request its session key let in (the key was checked against
        the stale metadata; a fresh keyless session would take the request). The admin, or
        a loopback client in protected mode, gets a new session as for any unknown id."""
        cached = self._sessions.pop(session_id, None)
        self._records.pop(session_id, None)
        if cached is None or (cached.key_hash and session_key_request.get() is not None):
            raise SessionNotFound(session_id)
