"""The one place that decides: lookup, classify, splice, generate, record.

A request arrives as a `Conversation`. Its lineage keys find the deepest stored turn whose
messages-plus-reply are a prefix of the request (one store round trip). The request is then
classified:

- `first`: the session has no turns yet;
- `extend`: it continues a leaf turn;
- `fork`: it continues a turn that already has a continuation;
- `retry`: the same input as an earlier turn (a new sibling with the same prompt);
- `rewrite`: the history no longer matches what was sampled; a new segment starts and the
  reason is recorded and counted.

The prompt of an extend/fork is the stored prompt + sampled tokens + the bridge for the new
messages only; nothing sampled is re-tokenized. After generation the engine's own report of
the prompt is checked against what was sent, and the new turns are stored atomically:
a request that fails stores nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import math
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, TypeVar

import numpy as np
import orjson

from session_server.conversation import (
    MAX_RULE_MATCHES,
    Conversation,
    ConversationError,
    Lineage,
    Message,
    Rule,
    check_normalization_cost,
    compile_rules,
    lineage,
    text_chars,
    validate,
)
from session_server.engines import EngineClient, EngineError, GenerationDelta
from session_server.export import (
    first_weight_version,
    stale_cache,
    turns_by_version,
    version_number,
)
from session_server.images import ImageInput, collapse, find_runs
from session_server.metrics import Metrics
from session_server.results import (
    ChoiceDelta,
    ChoiceFinished,
    ChoiceResult,
    StreamEvent,
    StreamFinished,
    StreamStarted,
    TurnResult,
)
from session_server.sampling import build_sampling
from session_server.service_config import ServiceConfig
from session_server.splice import BRIDGE_CONTEXT_TOKENS, ChatModel
from session_server.store.base import (
    IDEMPOTENCY_DONE,
    Finish,
    KeyTaken,
    LookupResult,
    RecordCache,
    RoutedExperts,
    SessionExists,
    SessionFinished,
    SessionMeta,
    SessionNotFound,
    SessionStore,
    StoreUnavailable,
    TurnRecord,
    WeightSpan,
)
from session_server.store.codec import stored_logprobs
from session_server.streaming import ReplyStreamer

# Set by the auth middleware, for a request that a session key (not the admin key, not
# protected mode) let in, to the SHA-256 digest of that key: such a request must never land
# in a session that key does not open (re-created, keyless or with a new key, through
# another server whose deletion this process's cached metadata has not seen).
session_key_request: ContextVar[str | None] = ContextVar("session_key_request", default=None)

RESPONSE_KEY_PREFIX = "resp:"
# Above these sizes a conversation's hashing and rendering run in a worker thread (the
# tokenizer releases the GIL for long texts, tokenizer.py): ~10 ms of work on the event loop
# at most, against a thread hand-off (~0.1 ms) that a usual turn does not pay.
OFF_LOOP_CHARS = 16_384
OFF_LOOP_MESSAGES = 2_048
ABORT_WAIT_S = 10.0
"""How long `abort` waits for the cut requests to store their turns and answer."""
ABORT_POLL_S = 0.25
"""While this server generates, how often it reads the aborts recorded through other
servers (`SessionStore.aborts_since`): one store command per poll, whatever the load."""
ABORTS_KEPT = 10_000
"""Sessions whose latest abort a server remembers (`TurnService._aborts`)."""
CLOCK_SKEW_S = 5.0
"""Aborts are read back this far before the oldest generation in flight here (servers'
clocks disagree by much less under NTP)."""
logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Recreated(Exception):
    """The session was deleted and created again behind this process's cached metadata."""


class SessionMissing(LookupError):
    """The session does not exist and sessions are not created on first use (404)."""


class ProofFailed(RuntimeError):
    """The engine reports a prompt other than the one tokenkeep sent (502)."""


class Refused(RuntimeError):
    """A request the core refuses as it stands, nothing stored: `status` (409, 422...),
    `kind` (the error type), `retry_after_s` when trying again later can succeed."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.retry_after_s = retry_after_s


class Aborted(Refused):
    """The request was cut by `POST /sessions/{id}/abort`: its generation (its cut turn is
    stored with finish_reason "abort"), or, `sent` False, before it reached the engine
    (nothing sampled, nothing stored). 400: an SDK does not resend it by itself."""

    def __init__(self, session_id: str, *, sent: bool = True) -> None:
        cut = (
            "generation aborted by POST /sessions/{id}/abort; the cut turn is stored with "
            "finish_reason abort"
            if sent
            else "request aborted by POST /sessions/{id}/abort before it reached the engine; "
            "nothing was sampled or stored"
        )
        super().__init__(
            400,
            cut.format(id=session_id) + " and the session stays usable",
            kind="aborted",
        )


class _Cut(Exception):
    """Internal: a flight was aborted while it waited for the engine."""


class _Flight:
    """One request of a session in flight here, from its planning on, which `abort` can
    cut. (A request waiting for an admission slot, or for the first request with its
    Idempotency-Key, is not known yet: it checks the aborts recorded since it arrived once
    it is.) Cut before its engine call, it is answered at once (`TurnService._unsent`);
    while it waits for the engine, `abort` cancels the task waiting for the engine (which
    closes the engine connection: vLLM then aborts the request) and that task resumes as if
    uncancelled, raising `_Cut`. A flight that is not waiting for the engine at that moment
    (handing a chunk to its client) stops before it waits again; cancellation never lands
    outside the engine wait."""

    __slots__ = ("aborted", "done", "started", "task", "waiting")

    def __init__(self, started: float) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.waiting = False
        self.aborted = False
        self.done = asyncio.Event()
        self.started = started
        """Unix time the request arrived: an abort recorded at or after it (through any
        server) cuts it."""

    def abort(self) -> None:
        if self.aborted:  # a second cancel would not be absorbed
            return
        self.aborted = True
        if self.waiting and self.task is not None:
            self.task.cancel()

    def _resumed(self) -> bool:
        """After a CancelledError: whether it was this flight's abort (then absorbed)."""
        return self.aborted and self.task is not None and self.task.uncancel() == 0

    async def run(self, awaitable: Awaitable[T]) -> T:
        if self.aborted:
            raise _Cut
        self.task = asyncio.current_task()
        self.waiting = True
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._resumed():
                raise _Cut from None
            raise
        finally:
            self.waiting = False

    async def events(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        while True:
            if self.aborted:
                raise _Cut
            self.task = asyncio.current_task()
            self.waiting = True
            try:
                event = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if self._resumed():
                    raise _Cut from None
                raise
            finally:
                self.waiting = False
            yield event


@dataclass(slots=True)
class Plan:
    """Everything decided before generation."""

    session: SessionMeta
    prompt_ids: list[int]
    parent_id: int | None
    segment_start: bool
    prompt_delta: list[int]
    kind: str
    break_reason: str | None
    lineage: Lineage | None
    """Message lineage (None for token-ID requests, which are keyed by tokens)."""
    n_messages: int
    sampling: dict[str, Any]
    splice_seconds: float
    volatile: list[str] = field(default_factory=list)
    """Text the session's normalisation rules ignored in this request (recorded)."""
    prompt_json: bytes = b""
    """`prompt_ids` as a JSON array, once known (from the session's cached prefix + the new
    tokens, or encoded for the engine request)."""
    earlier: list[TurnRecord] = field(default_factory=list)
    """The turns of this turn's segment before it (whose positions the engine may serve from
    its prefix cache: `stale_cache`)."""
    incarnation: str | None = None
    """The session incarnation its lookup read (the stored turns are held as of it)."""

    @property
    def route_start(self) -> int:
        """The first segment position whose experts this turn's request reports: its
        parent's last sampled token, which no earlier request forwarded (0 for a segment's
        first turn)."""
        if self.segment_start:
            return 0
        return len(self.prompt_ids) - len(self.prompt_delta) - 1


class TurnService:
    def __init__(
        self,
        store: SessionStore,
        engine: EngineClient,
        model: ChatModel,
        config: ServiceConfig,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.engine = engine
        self.model = model
        self.config = config
        self.metrics = metrics
        metrics.watch_engine(lambda: self.engine.replicas)
        # Session metadata never changes after creation, so it is cached to save a round
        # trip per request; a deleted session still fails at append time.
        self._sessions: dict[str, SessionMeta] = {}
        # Stored turns never change either: decoded records are kept per session so a
        # lookup transfers and decodes only turns this process has not seen. The store
        # checks the session's incarnation, so a deleted and re-created id is never served
        # from an old cache.
        self._records: OrderedDict[str, RecordCache] = OrderedDict()
        # (session, Idempotency-Key) -> set when this process's request holding it ends, so
        # a resend here wakes at once (resends through other replicas poll the store).
        self._claims: dict[tuple[str, str], asyncio.Event] = {}
        # Session -> its generations in flight in this process (`abort`), and the task that
        # cuts those an abort through another server reaches (runs while any are in flight).
        self._flights: dict[str, set[_Flight]] = {}
        self._abort_watch: asyncio.Task[None] | None = None
        # Session -> its latest abort known here (recorded here, or read by `_watch_aborts`),
        # for requests that arrived before it but reach this service after it.
        self._aborts: dict[str, float] = {}

    def engine_versions(self) -> dict[str, str | None]:
        """Replica URL -> the policy version it serves (None: not known yet)."""
        return {replica.url: replica.weight_version for replica in self.engine.replicas}

    def engine_version(self) -> float | None:
        """The newest numeric policy version any replica serves (None: none known)."""
        numbers = [
            version_number(replica.weight_version)
            for replica in self.engine.replicas
            if replica.weight_version is not None
        ]
        known = [n for n in numbers if n is not None]
        return max(known) if known else None

    def policy_lag(self, first: TurnRecord | None) -> tuple[str | None, bool]:
        """The version that sampled `first` (a rollout's first turn) and whether the engine
        has moved more than `max_policy_lag` versions past it."""
        version = first_weight_version([first] if first else [])
        return version, self.lag_exceeded(version)

    def lag_exceeded(self, first_version: str | None) -> bool:
        """Whether the engine has moved more than `max_policy_lag` versions past the version
        that sampled a rollout's first turn (never without a bound or numeric versions)."""
        lag = self.config.max_policy_lag
        start = None if first_version is None else version_number(first_version)
        current = self.engine_version()
        if lag is None or start is None or current is None:
            return False
        return current > start + lag

    async def finish(self, session_id: str, finish: Finish) -> int:
        """Freeze the session as it is stored now: its finish (keeping the version that
        sampled its first turn, from which finished listings show the policy lag) is set
        atomically with respect to appends, so no turn is stored after it and an export taken
        now is final. Then its generations still in flight, here and on every server sharing
        the store, are cut: they can no longer be stored, and their clients are answered
        `session_finished` (409). Returns how many were cut on this server. Raises as
        `finish_session` (AlreadyFinished: nothing frozen, nothing cut)."""
        first = (await self.store.get_turns(session_id, [1]))[0]
        finish.first_weight_version = first_weight_version([first] if first else [])
        await self.store.finish_session(session_id, finish)
        return await self.abort(session_id)

    def _check_policy_lag(self, found: LookupResult) -> None:
        """Refuse, before any engine call, a turn of a rollout that drifted too far
        off-policy (`--max-policy-lag`)."""
        if self.config.max_policy_lag is None:
            return
        if found.retry_of is not None:
            root = found.retry_path[0] if found.retry_path else found.retry_of
        else:
            root = found.parent_path[0] if found.parent_path else None
        version, exceeded = self.policy_lag(root)
        if exceeded:
            self.metrics.rejections.labels(reason="policy_lag").inc()
            raise Refused(
                409,
                f"policy lag exceeded: this rollout's first turn was sampled at version "
                f"{version}, the engine serves {self.engine_version():g} "
                f"(--max-policy-lag {self.config.max_policy_lag}); start a new rollout",
                kind="policy_lag_exceeded",
            )

    # --- sessions -------------------------------------------------------------------

    async def keyed_session(
        self, session_id: str, opens: Callable[[SessionMeta], bool]
    ) -> SessionMeta | None:
        """The session's metadata if `opens` accepts it (a session key checked against its
        digest), else None. A refusal by the cached metadata is checked again against the
        store, which replaces the cache: the session may have been deleted and created again
        with a new key through another server. So a new key is never refused by a stale
        cache, and a wrong key costs one store read whether or not the session exists (its
        answer time says nothing about that). A stale cache that accepts an old key is caught
        by the turn's lookup (`_check_current`)."""
        cached = self._sessions.get(session_id)
        if cached is not None and opens(cached):
            return cached
        meta = await self.store.get_session(session_id)
        if meta is None:
            self._sessions.pop(session_id, None)
            return None
        self._remember(meta)
        return meta if opens(meta) else None

    async def session(self, session_id: str, *, create: bool | None = None) -> SessionMeta:
        cached = self._sessions.get(session_id)
        if cached is not None:
            return cached
        meta = await self.store.get_session(session_id)
        if meta is None:
            if not (self.config.create_on_first_use if create is None else create):
                raise SessionMissing(session_id)
            meta = await self.create_session(session_id)
        self._remember(meta)
        return meta

    async def create_session(
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

    async def delete_session(self, session_id: str) -> bool:
        self._sessions.pop(session_id, None)
        self._records.pop(session_id, None)
        return await self.store.delete_session(session_id)

    def _record_cache(self, session_id: str) -> RecordCache:
        cache = self._records.get(session_id)
        if cache is None:
            cache = self._records[session_id] = RecordCache()
            if len(self._records) > self.config.max_sessions_cached:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(session_id)
        return cache

    def _remember(self, meta: SessionMeta) -> None:
        self._sessions.pop(meta.session_id, None)
        if len(self._sessions) >= self.config.max_sessions_cached:
            self._sessions.pop(next(iter(self._sessions)))
        self._sessions[meta.session_id] = meta

    # --- planning ---------------------------------------------------------------------

    def check_fits(self, chars: int, messages: int = 0, param: str = "messages") -> None:
        """Refuse what cannot fit the context before spending time tokenizing it: more
        characters than the context's tokens can carry, or more messages than tokens (every
        template marks each message with at least one token)."""
        limit = self.config.max_text_chars
        context = self.config.context_length
        if (limit is not None and chars > limit) or messages > context:
            what = f"{messages} messages" if messages > context else f"{chars} characters"
            raise ConversationError(
                f"{what} cannot fit the model's context of {context} tokens", param=param
            )

    async def plan(self, session_id: str, conversation: Conversation) -> Plan:
        validate(conversation)
        chars = text_chars(conversation)
        self.check_fits(chars, len(conversation.messages))
        many = len(conversation.messages) > OFF_LOOP_MESSAGES
        return await self._fresh_session_retry(
            session_id,
            lambda: self._plan_messages(session_id, conversation, many, chars > OFF_LOOP_CHARS),
        )

    async def _fresh_session_retry(
        self, session_id: str, attempt: Callable[[], Awaitable[Plan]]
    ) -> Plan:
        """Plan once more if the session expired or was deleted behind the cached metadata
        (then it is created again, when sessions are created on first use), or was deleted
        and created again (the plan is then made with the new session's metadata: its
        sampling overrides, its rules, and its key, which must open it)."""
        try:
            return await attempt()
        except _Recreated:
            self._sessions.pop(session_id, None)
            digest = session_key_request.get()
            if digest:
                meta = await self.store.get_session(session_id)
                if meta is None or not hmac.compare_digest(meta.key_hash, digest):
                    raise Refused(
                        401, "wrong or expired API key", kind="authentication_error"
                    ) from None
            return await attempt()
        except SessionNotFound:
            self._forget(session_id)
            return await attempt()

    def _check_current(self, meta: SessionMeta, found: LookupResult) -> None:
        """Before anything is generated: the session the lookup read is the one `meta`
        describes (not deleted and created again since it was cached), and it is not
        finished (a finished rollout is final)."""
        if found.incarnation != meta.incarnation:
            raise _Recreated(meta.session_id)
        if found.finished:
            raise self._finished(meta.session_id)

    def _finished(self, session_id: str) -> Refused:
        self.metrics.rejections.labels(reason="session_finished").inc()
        return Refused(
            409,
            f"session {session_id!r} is finished: a finished rollout takes no more turns "
            "(nothing was stored)",
            kind="session_finished",
        )

    def _forget(self, session_id: str) -> None:
        """The session is gone behind this process's cached metadata (deleted or expired
        through another replica). Raises SessionNotFound unless it may be created again on
        first use: never for a request its session key let in (the key was checked against
        the stale metadata; a fresh keyless session would take the request). The admin, or
        a loopback client in protected mode, gets a new session as for any unknown id."""
        cached = self._sessions.pop(session_id, None)
        self._records.pop(session_id, None)
        if cached is None or (cached.key_hash and session_key_request.get() is not None):
            raise SessionNotFound(session_id)

    async def _plan_messages(
        self,
        session_id: str,
        conversation: Conversation,
        many: bool = False,
        long: bool = False,
    ) -> Plan:
        """Work that would hold the event loop, and every other session with it, for tens
        of ms or more runs in a worker thread: hashing and classifying `many` messages, and
        rendering a `long` conversation that no stored turn continues (a first turn
        tokenizes all of it). A turn that extends stored tokens stays on the loop: the
        thread hand-off would cost more than its work."""
        started = time.perf_counter()
        meta = await self.session(session_id)
        rules = compile_rules(meta.normalization) if meta.normalization else None
        if rules:
            check_normalization_cost(conversation, rules)
        if conversation.previous_response_id:
            found, keys = await self._continue_response(session_id, conversation, rules)
        else:
            keys = (
                await asyncio.to_thread(lineage, conversation, rules)
                if many
                else lineage(conversation, rules)
            )
            found = await self.store.lookup(
                session_id,
                keys.reply_keys_for_lookup(),
                keys.input_key,
                known=self._record_cache(session_id),
            )
        self._check_current(meta, found)
        self._check_policy_lag(found)
        plan = (
            await asyncio.to_thread(self._classify, meta, conversation, keys, found)
            if many or (long and not found.parent_path and found.retry_of is None)
            else self._classify(meta, conversation, keys, found)
        )
        plan.earlier = _earlier(plan, found)
        plan.incarnation = found.incarnation
        if rules:
            plan.volatile = volatile_parts(conversation, rules)
        plan.splice_seconds = time.perf_counter() - started
        if conversation.required_prefix_token_ids is not None:
            prefix = conversation.required_prefix_token_ids
            if plan.prompt_ids[: len(prefix)] != prefix:
                raise ConversationError(
                    "required_prefix_token_ids is not a prefix of this session's prompt",
                    param="required_prefix_token_ids",
                )
        plan.sampling = build_sampling(
            conversation,
            meta.sampling_overrides,
            self.config,
            self.model,
            prompt_length=len(plan.prompt_ids),
        )
        _ask_for_routes(plan)
        return plan

    async def plan_tokens(
        self, session_id: str, prompt_ids: list[int], conversation: Conversation
    ) -> Plan:
        """Classify a token-ID prompt: the deepest stored turn whose prompt + sampled
        tokens are a prefix of it is its parent, and only the rest is new."""
        if not prompt_ids:
            raise ConversationError("prompt must not be empty", param="prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ConversationError(f"token ids out of vocabulary: {bad[:5]}", param="prompt")
        return await self._fresh_session_retry(
            session_id, lambda: self._plan_tokens(session_id, prompt_ids, conversation)
        )

    async def _plan_tokens(
        self, session_id: str, prompt_ids: list[int], conversation: Conversation
    ) -> Plan:
        started = time.perf_counter()
        meta = await self.session(session_id)
        cuts = token_cut_points(prompt_ids, set(self.model.stop_token_ids))
        cut_keys = token_prefix_keys(prompt_ids, cuts)
        found = await self.store.lookup(
            session_id,
            cut_keys,
            token_input_key(prompt_ids),
            known=self._record_cache(session_id),
        )
        self._check_current(meta, found)
        self._check_policy_lag(found)
        n = len(prompt_ids)
        if found.retry_of is not None:
            plan = self._retry(meta, conversation, None, prompt_ids, found.retry_of)
        elif found.parent_path and found.matched_key_index is not None:
            cut = cuts[found.matched_key_index]
            stored = _tokens_through(found.parent_path)
            if stored != prompt_ids[:cut]:  # a hash collision: never trust it
                raise ProofFailed("token lookup matched a turn whose tokens differ")
            kind = "fork" if found.parent_children else "extend"
            plan = self._plan(
                meta,
                conversation,
                None,
                prompt=prompt_ids,
                parent_id=found.parent_path[-1].turn_id,
                segment_start=False,
                delta=prompt_ids[cut:],
                kind=kind,
                reason=None,
            )
        elif found.turn_count == 0:
            plan = self._fresh(meta, conversation, None, prompt_ids, None, "first", None)
        else:
            plan = self._fresh(
                meta, conversation, None, prompt_ids, None, "rewrite", "history_mismatch"
            )
        plan.n_messages = 0
        plan.earlier = _earlier(plan, found)
        plan.incarnation = found.incarnation
        plan.splice_seconds = time.perf_counter() - started
        plan.sampling = build_sampling(
            conversation, meta.sampling_overrides, self.config, self.model, prompt_length=n
        )
        _ask_for_routes(plan)
        return plan

    async def _continue_response(
        self, session_id: str, conversation: Conversation, rules: list[Rule] | None
    ) -> tuple[LookupResult, Lineage]:
        """A Responses API request that names the turn it continues and sends only the
        items after it. The lineage continues from that turn's stored reply key, so a later
        request that resends the whole history finds the same turns."""
        key = RESPONSE_KEY_PREFIX + str(conversation.previous_response_id)
        if await self.store.resolve_key(session_id, key) is None:
            raise ConversationError(
                f"previous_response_id {conversation.previous_response_id!r} is not a "
                "response of this session",
                param="previous_response_id",
            )
        found = await self.store.lookup(
            session_id, [key], None, known=self._record_cache(session_id)
        )
        keys = lineage(conversation, rules, after=found.parent_path[-1].extra.get("reply_key"))
        return found, keys

    def _classify(
        self,
        meta: SessionMeta,
        conversation: Conversation,
        keys: Lineage,
        found: LookupResult,
    ) -> Plan:
        messages = conversation.messages
        if found.retry_of is not None:
            prompt = _prompt_of(found.retry_path, found.retry_of)
            return self._retry(meta, conversation, keys, prompt, found.retry_of)
        if found.parent_path:
            parent = found.parent_path[-1]
            if conversation.previous_response_id:
                matched = -1
                history: list[Message] = []
                new_messages = messages
            else:
                assert found.matched_key_index is not None
                matched = keys.assistant_positions[found.matched_key_index]
                history = messages[: matched + 1]
                new_messages = messages[matched + 1 :]
            stored = _tokens_through(found.parent_path)
            prompt_end = len(stored) - len(parent.completion_ids)
            bridge = self.model.bridge(
                stored[max(0, prompt_end - BRIDGE_CONTEXT_TOKENS) : prompt_end],
                parent.completion_ids,
                parent.finish_reason,
                history,
                new_messages,
                conversation.tools,
            )
            if bridge.delta is not None:
                kind = "fork" if found.parent_children else "extend"
                plan = self._plan(
                    meta,
                    conversation,
                    keys,
                    prompt=stored + bridge.delta,
                    parent_id=parent.turn_id,
                    segment_start=False,
                    delta=bridge.delta,
                    kind=kind,
                    reason=None,
                )
                plan.prompt_json = self._extended_json(
                    meta.session_id, parent.turn_id, stored, bridge.delta
                )
                return plan
            return self._rewrite(meta, conversation, keys, parent.turn_id, bridge.refusal)
        if found.turn_count == 0:
            prompt = self._fresh_prompt(conversation)
            return self._fresh(meta, conversation, keys, prompt, None, "first", None)
        return self._rewrite(meta, conversation, keys, None, "history_mismatch")

    def _extended_json(
        self, session_id: str, parent_id: int, stored: list[int], delta: list[int]
    ) -> bytes:
        """The JSON array of `stored + delta` from the JSON this process sent for the turn
        it extends (b"" when it has none). Encoding the whole history for every engine
        request was the largest O(history) cost of a turn. Besides the turn id, the cached
        array must hold as many tokens as `stored` and end with the same ones: an entry
        from another incarnation of the session can never stand in for this one's tokens
        (the engine's echo is compared with these bytes, so they must be right)."""
        cache = self._records.get(session_id)  # no reordering: this may run off the loop
        entry = cache.tokens_json.get(parent_id) if cache is not None else None
        if entry is None or entry[0] != len(stored):
            return b""
        if not entry[1].endswith(orjson.dumps(stored[-16:])[1:]):
            return b""
        return _json_extend(entry[1], delta)

    def _fresh_prompt(self, conversation: Conversation) -> list[int]:
        """A whole prompt for a request no stored turn continues. A token-aware client that
        sent the tokens of its last assistant turn (`prompt_token_ids` +
        `generation_token_ids`) keeps them: the later messages are bridged onto them, and
        the result is proved like any splice. Otherwise the chat template renders it."""
        messages = conversation.messages
        for j in range(len(messages) - 1, -1, -1):
            message = messages[j]
            if message.role != "assistant":
                continue
            if message.prompt_token_ids and message.generation_token_ids:
                bridge = self.model.bridge(
                    message.prompt_token_ids,
                    message.generation_token_ids,
                    "length"
                    if message.generation_token_ids[-1] not in self.model.stop_token_ids
                    else "stop",
                    messages[: j + 1],
                    messages[j + 1 :],
                    conversation.tools,
                )
                if bridge.delta is not None:
                    return [
                        *message.prompt_token_ids,
                        *message.generation_token_ids,
                        *bridge.delta,
                    ]
            break
        return self.model.render_prompt(messages, conversation.tools)

    def _rewrite(
        self,
        meta: SessionMeta,
        conversation: Conversation,
        keys: Lineage,
        parent_id: int | None,
        reason: str | None,
    ) -> Plan:
        prompt = self._fresh_prompt(conversation)
        return self._fresh(
            meta, conversation, keys, prompt, parent_id, "rewrite", reason or "history_mismatch"
        )

    def _retry(
        self,
        meta: SessionMeta,
        conversation: Conversation,
        keys: Lineage | None,
        prompt: list[int],
        retry: TurnRecord,
    ) -> Plan:
        """A new sibling of `retry` with the same prompt (both the message and token paths)."""
        return self._plan(
            meta,
            conversation,
            keys,
            prompt=prompt,
            parent_id=retry.parent_id,
            segment_start=retry.segment_start,
            delta=retry.prompt_delta,
            kind="retry",
            reason=retry.break_reason,
        )

    def _fresh(
        self,
        meta: SessionMeta,
        conversation: Conversation,
        keys: Lineage | None,
        prompt: list[int],
        parent_id: int | None,
        kind: str,
        reason: str | None,
    ) -> Plan:
        """A turn that starts a new segment (`first` or `rewrite`): its whole prompt is new."""
        return self._plan(
            meta,
            conversation,
            keys,
            prompt=prompt,
            parent_id=parent_id,
            segment_start=True,
            delta=prompt,
            kind=kind,
            reason=reason,
        )

    def _plan(
        self,
        meta: SessionMeta,
        conversation: Conversation,
        keys: Lineage | None,
        *,
        prompt: list[int],
        parent_id: int | None,
        segment_start: bool,
        delta: list[int],
        kind: str,
        reason: str | None,
    ) -> Plan:
        return Plan(
            session=meta,
            prompt_ids=prompt,
            parent_id=parent_id,
            segment_start=segment_start,
            prompt_delta=list(delta),
            kind=kind,
            break_reason=reason,
            lineage=keys,
            n_messages=len(conversation.messages),
            sampling={},
            splice_seconds=0.0,
        )

    # --- generation -------------------------------------------------------------------

    async def complete(self, session_id: str, conversation: Conversation) -> TurnResult:
        return await self._complete_once(
            session_id, conversation, lambda: self.plan(session_id, conversation)
        )

    def stream(self, session_id: str, conversation: Conversation) -> AsyncIterator[StreamEvent]:
        return self._stream_once(
            session_id, conversation, lambda: self.plan(session_id, conversation)
        )

    async def complete_tokens(
        self, session_id: str, prompt_ids: list[int], conversation: Conversation
    ) -> TurnResult:
        """A client that sends the token prompt itself (`/v1/completions`)."""
        return await self._complete_once(
            session_id, conversation, lambda: self.plan_tokens(session_id, prompt_ids, conversation)
        )

    def stream_tokens(
        self, session_id: str, prompt_ids: list[int], conversation: Conversation
    ) -> AsyncIterator[StreamEvent]:
        return self._stream_once(
            session_id, conversation, lambda: self.plan_tokens(session_id, prompt_ids, conversation)
        )

    async def _complete_once(
        self, session_id: str, conversation: Conversation, plan: Callable[[], Awaitable[Plan]]
    ) -> TurnResult:
        claimed = await self._claim(session_id, conversation)
        if isinstance(claimed, TurnResult):
            return claimed
        flight = self._take_off(session_id, conversation.arrived)
        try:
            result = await self._complete(await plan(), conversation, flight)
        except BaseException:
            await self._release(session_id, conversation, claimed)
            raise
        finally:
            self._land(session_id, flight)
        self._settled(session_id, conversation)
        return result

    async def _stream_once(
        self, session_id: str, conversation: Conversation, plan: Callable[[], Awaitable[Plan]]
    ) -> AsyncIterator[StreamEvent]:
        claimed = await self._claim(session_id, conversation)
        if isinstance(claimed, TurnResult):
            for event in replay_events(claimed):
                yield event
            return
        stored = False
        flight = self._take_off(session_id, conversation.arrived)
        try:
            planned = await plan()
            async with contextlib.aclosing(self._stream(planned, conversation, flight)) as events:
                async for event in events:
                    stored = stored or isinstance(event, StreamFinished)
                    yield event
        finally:
            self._land(session_id, flight)
            if stored:
                self._settled(session_id, conversation)
            else:
                await self._release(session_id, conversation, claimed)

    # --- abort --------------------------------------------------------------------------

    async def abort(self, session_id: str) -> int:
        """Cut every generation of the session in flight: the abort is recorded in the store
        (other servers sharing it cut theirs within ABORT_POLL_S, `_watch_aborts`), then
        those in this process are cut: each stores its cut turn (finish_reason "abort") and
        answers its client with `Aborted`. Returns how many were cut here, once they have
        answered (or after ABORT_WAIT_S)."""
        at = time.time()
        await self.store.record_abort(session_id, at)
        self._known_abort(session_id, at)
        flights = list(self._flights.get(session_id, ()))
        for flight in flights:
            flight.abort()
        if flights:
            await asyncio.wait(
                [asyncio.ensure_future(f.done.wait()) for f in flights], timeout=ABORT_WAIT_S
            )
        return len(flights)

    def _take_off(self, session_id: str, arrived: float | None) -> _Flight:
        """Register a request as in flight; already aborted when an abort known here was
        recorded at or after it arrived (it waited for an admission slot meanwhile)."""
        flight = _Flight(time.time() if arrived is None else arrived)
        flight.aborted = self._aborts.get(session_id, -1.0) >= flight.started
        self._flights.setdefault(session_id, set()).add(flight)
        if self._abort_watch is None or self._abort_watch.done():
            self._abort_watch = asyncio.create_task(self._watch_aborts())
        return flight

    async def _watch_aborts(self) -> None:
        """While generations are in flight here: cut those that an abort recorded through
        any server reaches (started at or before it). Ends when none is left."""
        while self._flights:
            await asyncio.sleep(ABORT_POLL_S)
            if not self._flights:
                return
            oldest = min(f.started for flights in self._flights.values() for f in flights)
            try:
                aborts = await self.store.aborts_since(oldest - CLOCK_SKEW_S)
            except StoreUnavailable:  # the store logs it; its own retries failed: poll again
                continue
            except Exception:  # a bug: stay loud, but keep watching
                logger.exception("reading the recorded aborts failed")
                continue
            for session_id, at in aborts.items():
                self._known_abort(session_id, at)
                for flight in list(self._flights.get(session_id, ())):
                    if flight.started <= at:
                        flight.abort()

    def _known_abort(self, session_id: str, at: float) -> None:
        if at > self._aborts.get(session_id, -1.0):
            self._aborts[session_id] = at
        if len(self._aborts) > ABORTS_KEPT:  # the oldest are far older than any request
            for old in sorted(self._aborts, key=self._aborts.__getitem__)[: ABORTS_KEPT // 2]:
                del self._aborts[old]

    def _unsent(self, session_id: str, flight: _Flight) -> None:
        """Before the engine call: a request aborted while it waited for a slot or was being
        planned is answered now, with no engine call and nothing stored (nothing sampled)."""
        if flight.aborted:
            self.metrics.aborted_requests.inc()
            raise Aborted(session_id, sent=False)

    def _land(self, session_id: str, flight: _Flight) -> None:
        """Past the engine call (or failed before it): an abort no longer cuts it."""
        flights = self._flights.get(session_id)
        if flights is not None:
            flights.discard(flight)
            if not flights:
                del self._flights[session_id]
        flight.done.set()

    async def _record_cut(
        self,
        plan: Plan,
        conversation: Conversation,
        tokens: list[list[int]],
        logprobs: list[list[float]] | None = None,
        versions: list[list[WeightSpan]] | None = None,
    ) -> NoReturn:
        """Store what an aborted generation sampled (finish_reason "abort"), then raise
        Aborted: nothing sampled is dropped, and the client hears why it got no reply."""
        sampled = []
        for i, ids in enumerate(tokens):
            reply = self.model.parse(ids, "length", plan.prompt_ids, conversation.tools)
            sampled.append(
                _Sampled(
                    i,
                    list(ids),
                    list(logprobs[i]) if logprobs else [],
                    "abort",
                    None,
                    reply.message,
                    "abort",
                    versions[i] if versions else [],
                )
            )
        await self._record(plan, conversation, sampled)
        self.metrics.aborted_requests.inc()
        raise Aborted(plan.session.session_id)

    # --- idempotency keys ---------------------------------------------------------------

    async def _claim(self, session_id: str, conversation: Conversation) -> TurnResult | str | None:
        """For a request with an Idempotency-Key: the stored reply of the request that used
        the key first (waiting while that one generates, here or on another replica), or
        the owner token under which this request now holds the key. None without a key."""
        idem = conversation.idempotency
        if idem is None:
            return None
        owner = uuid.uuid4().hex
        deadline = time.monotonic() + self.config.idempotency_wait_s
        delay = 0.05
        while True:
            await self.session(session_id)
            try:
                claim = await self.store.claim_idempotency(
                    session_id,
                    idem.key,
                    idem.fingerprint,
                    owner=owner,
                    stale_after_s=self.config.idempotency_stale_s,
                )
            except SessionNotFound:  # deleted behind the cached metadata
                self._forget(session_id)
                continue
            if claim.state == "owned":
                self._claims.setdefault((session_id, idem.key), asyncio.Event())
                return owner
            if claim.state == "done":
                return await self._replay(session_id, conversation, claim.turn_id)
            if claim.fingerprint != idem.fingerprint:
                raise _key_reused(idem.key)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Refused(
                    409,
                    f"the request with Idempotency-Key {idem.key!r} is still generating",
                    kind="idempotency_pending",
                    retry_after_s=1,
                )
            local = self._claims.get((session_id, idem.key))
            if local is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(local.wait(), remaining)
            else:
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.5)

    def _settled(self, session_id: str, conversation: Conversation) -> None:
        if conversation.idempotency is not None:
            event = self._claims.pop((session_id, conversation.idempotency.key), None)
            if event is not None:
                event.set()

    async def _release(
        self, session_id: str, conversation: Conversation, owner: TurnResult | str | None
    ) -> None:
        """The request holding a key failed (nothing stored): free the key for a resend."""
        idem = conversation.idempotency
        if idem is None or not isinstance(owner, str):
            return
        try:
            await self.store.release_idempotency(session_id, idem.key, owner)
        except Exception:  # the claim then goes stale: a resend takes it over later
            logger.warning("could not release Idempotency-Key %r", idem.key, exc_info=True)
        finally:
            self._settled(session_id, conversation)

    async def _replay(
        self, session_id: str, conversation: Conversation, turn_id: int
    ) -> TurnResult:
        """The reply stored under an Idempotency-Key, rebuilt from its turns: the same
        response id, turn ids, tokens and (parsed from them again) messages."""
        assert conversation.idempotency is not None
        found = await self.store.lookup(
            session_id,
            [IDEMPOTENCY_DONE + conversation.idempotency.key],
            None,
            known=self._record_cache(session_id),
        )
        first = found.parent_path[-1]
        stamp = first.extra.get("idempotency") or {}
        if stamp.get("fingerprint") != conversation.idempotency.fingerprint:
            raise _key_reused(conversation.idempotency.key)
        n = int(stamp.get("choices", 1))
        rest = await self.store.get_turns(session_id, list(range(turn_id + 1, turn_id + n)))
        turns = [first, *(t for t in rest if t is not None)]
        prompt = _prompt_of(found.parent_path[:-1], first)
        meta = await self.session(session_id)
        choices = []
        for index, turn in enumerate(turns):
            reply = self.model.parse(
                turn.completion_ids, turn.finish_reason, prompt, conversation.tools
            )
            choices.append(
                ChoiceResult(
                    index=index,
                    turn_id=turn.turn_id,
                    message=reply.message,
                    token_ids=list(turn.completion_ids),
                    logprobs=list(turn.logprobs),
                    finish_reason=reply.finish_reason,
                    stop_reason=turn.stop_reason,
                )
            )
        self.metrics.idempotent_replays.inc()
        return TurnResult(
            session_id=session_id,
            prompt_ids=prompt,
            choices=choices,
            kind=first.kind,
            break_reason=first.break_reason,
            created=int(first.created_at),
            model=self.config.model_name,
            response_id=str(stamp.get("response_id", "")),
            parent_turn_id=first.parent_id,
            return_token_ids=return_token_ids(conversation, meta),
        )

    async def _complete(
        self, plan: Plan, conversation: Conversation, flight: _Flight
    ) -> TurnResult:
        session_id = plan.session.session_id
        sent, images = self._engine_prompt(plan, conversation)
        started = time.perf_counter()
        self._unsent(session_id, flight)
        plan.prompt_json = plan.prompt_json or orjson.dumps(plan.prompt_ids)
        try:
            generation = await flight.run(
                self.engine.generate(
                    session_id,
                    sent,
                    plan.sampling,
                    reasoning_ended=conversation.reasoning_ended,
                    images=images,
                    prompt_json=None if images else plan.prompt_json,
                )
            )
        except _Cut:
            # vLLM returns nothing of a non-streamed request it aborted: the cut turn holds
            # no tokens (a streamed request keeps every token that arrived).
            await self._record_cut(plan, conversation, [[]] * conversation.n)
        finally:
            self._land(session_id, flight)
        self.metrics.engine_seconds.observe(time.perf_counter() - started)
        self._check_proof(plan, generation.prompt_ids)
        nothing: list[list[int]] = [[]] * conversation.n
        for choice in generation.choices:
            self._check_reply(plan, nothing, choice.index, choice.token_ids)
        replies = [
            (
                choice,
                self.model.parse(
                    choice.token_ids, choice.finish_reason, plan.prompt_ids, conversation.tools
                ),
            )
            for choice in generation.choices
        ]
        return await self._record(
            plan,
            conversation,
            [
                _Sampled(
                    c.index,
                    c.token_ids,
                    c.logprobs,
                    c.finish_reason,
                    c.stop_reason,
                    reply.message,
                    reply.finish_reason,
                    c.weight_versions,
                    c.routed_experts,
                )
                for c, reply in replies
            ],
            cached_tokens=generation.cached_tokens,
        )

    async def _stream(
        self, plan: Plan, conversation: Conversation, flight: _Flight
    ) -> AsyncIterator[StreamEvent]:
        session_id = plan.session.session_id
        response_id = uuid.uuid4().hex
        started = time.perf_counter()
        streamers = [ReplyStreamer(self.model, plan.prompt_ids) for _ in range(conversation.n)]
        tokens: list[list[int]] = [[] for _ in range(conversation.n)]
        logprobs: list[list[float]] = [[] for _ in range(conversation.n)]
        finish: list[tuple[str, int | str | None] | None] = [None] * conversation.n
        versions: list[list[WeightSpan]] = [[] for _ in range(conversation.n)]
        routes: list[np.ndarray | None] = [None] * conversation.n
        cached: int | None = None
        announced = False
        sent, images = self._engine_prompt(plan, conversation)
        self._unsent(session_id, flight)
        plan.prompt_json = plan.prompt_json or orjson.dumps(plan.prompt_ids)
        engine_stream = self.engine.stream(
            session_id,
            sent,
            plan.sampling,
            reasoning_ended=conversation.reasoning_ended,
            images=images,
            prompt_json=None if images else plan.prompt_json,
        )
        try:
            async with contextlib.aclosing(engine_stream) as events:
                async for event in flight.events(events):
                    if isinstance(event, GenerationDelta):
                        if not announced:
                            announced = True
                            yield self._started(plan, conversation, response_id)
                        i = event.index
                        self._check_reply(plan, tokens, i, event.token_ids)
                        tokens[i].extend(event.token_ids)
                        logprobs[i].extend(event.logprobs)
                        text = streamers[i].feed(event.token_ids)
                        if event.token_ids or text.content or text.reasoning:
                            yield ChoiceDelta(
                                index=i,
                                token_ids=list(event.token_ids),
                                logprobs=list(event.logprobs),
                                content=text.content,
                                reasoning=text.reasoning,
                            )
                        if event.finish_reason is not None:
                            finish[i] = (event.finish_reason, event.stop_reason)
                        if event.weight_versions is not None:
                            versions[i] = event.weight_versions
                        if event.routed_experts is not None:
                            routes[i] = event.routed_experts
                        if event.cached_tokens is not None:
                            cached = event.cached_tokens
                    else:  # the engine's report of the prompt it received
                        self._check_proof(plan, event.prompt_ids)
        except _Cut:
            # Closing the engine stream (above) closed its connection: vLLM stopped it.
            await self._record_cut(plan, conversation, tokens, logprobs, versions)
        finally:
            self._land(session_id, flight)
        self.metrics.engine_seconds.observe(time.perf_counter() - started)
        if not announced:
            yield self._started(plan, conversation, response_id)
        sampled: list[_Sampled] = []
        for i in range(conversation.n):
            reason, stop_reason = finish[i] or ("stop", None)
            reply = self.model.parse(tokens[i], reason, plan.prompt_ids, conversation.tools)
            tail = streamers[i].finish(reply.message)
            yield ChoiceFinished(
                index=i,
                message=reply.message,
                finish_reason=reply.finish_reason,
                content_tail=tail.content,
                reasoning_tail=tail.reasoning,
            )
            sampled.append(
                _Sampled(
                    i,
                    tokens[i],
                    logprobs[i],
                    reason,
                    stop_reason,
                    reply.message,
                    reply.finish_reason,
                    versions[i],
                    routes[i],
                )
            )
        result = await self._record(
            plan, conversation, sampled, response_id=response_id, cached_tokens=cached
        )
        yield StreamFinished(result=result)

    def _started(self, plan: Plan, conversation: Conversation, response_id: str) -> StreamStarted:
        return StreamStarted(
            session_id=plan.session.session_id,
            prompt_ids=plan.prompt_ids,
            kind=plan.kind,
            break_reason=plan.break_reason,
            created=int(time.time()),
            model=self.config.model_name,
            n=conversation.n,
            response_id=response_id,
            return_token_ids=return_token_ids(conversation, plan.session),
        )

    def _engine_prompt(
        self, plan: Plan, conversation: Conversation
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt as vLLM's token-in endpoint takes images: one pad per image and every
        image so far, in order (it expands them and echoes the expanded prompt, which the
        proof then compares with the stored one)."""
        vision = self.model.vision
        if vision is None:
            return plan.prompt_ids, ()
        images = [image for m in conversation.messages for image in m.images]
        runs = find_runs(plan.prompt_ids, images, vision)
        if not runs:
            return plan.prompt_ids, ()
        return collapse(plan.prompt_ids, runs), tuple(images)

    async def _keep_images(self, plan: Plan, conversation: Conversation) -> list[dict[str, Any]]:
        """Store the images this turn's prompt delta added (once per hash per session; the
        earlier ones were stored by the turns that added them) and describe them, offsets
        relative to the delta (the export shifts them into segment coordinates)."""
        vision = self.model.vision
        images = {image.sha256: image for m in conversation.messages for image in m.images}
        if vision is None or not images:
            return []
        delta_start = len(plan.prompt_ids) - len(plan.prompt_delta)
        runs = find_runs(
            plan.prompt_ids, [i for m in conversation.messages for i in m.images], vision
        )
        added = [run for run in runs if run.offset >= delta_start]
        # Called with no new image too: the Redis store refreshes the images' time to live.
        await self.store.put_images(
            plan.session.session_id, {run.sha256: images[run.sha256].data for run in added}
        )
        return [
            {
                "sha256": run.sha256,
                "offset": run.offset - delta_start,
                "length": run.length,
                "width": images[run.sha256].width,
                "height": images[run.sha256].height,
            }
            for run in added
        ]

    def _check_proof(self, plan: Plan, reported: list[int] | None) -> None:
        if reported is not None and reported != plan.prompt_ids:
            self.metrics.proof_failures.inc()
            raise ProofFailed(
                "the engine reports a prompt that differs from the spliced prompt "
                f"({len(reported)} vs {len(plan.prompt_ids)} tokens); nothing was stored"
            )

    def _check_reply(
        self, plan: Plan, received: list[list[int]], index: int, token_ids: list[int]
    ) -> None:
        """`token_ids`, sent for choice `index` after `received[index]`, must be what the
        engine could sample for this request, else the reply is the engine's fault and
        nothing is stored: a negative token id failed the store's encoding (a 500), one past
        the vocabulary was stored, a stream past `max_tokens` was relayed without bound."""
        limit, vocab = plan.sampling["max_tokens"], self.model.vocab_size
        if not 0 <= index < len(received):
            reason, fault = "choice", f"choice {index} of a request for {len(received)}"
        elif len(received[index]) + len(token_ids) > limit:
            reason, fault = "max_tokens", f"more than max_tokens ({limit}) tokens"
        elif token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            bad = [t for t in token_ids if not 0 <= t < vocab]
            reason, fault = "vocabulary", f"token ids outside the vocabulary: {bad[:5]}"
        else:
            return
        self.metrics.engine_reply_faults.labels(reason=reason).inc()
        raise EngineError(
            502, f"the engine sent {fault}; nothing was stored", "EngineProtocolError"
        )

    async def _record(
        self,
        plan: Plan,
        conversation: Conversation,
        sampled: list[_Sampled],
        *,
        response_id: str | None = None,
        cached_tokens: int | None = None,
    ) -> TurnResult:
        response_id = response_id or uuid.uuid4().hex
        cache: dict[str, Any] = {} if cached_tokens is None else {"cached_tokens": cached_tokens}
        records: list[TurnRecord] = []
        keys: list[list[str]] = []
        images = await self._keep_images(plan, conversation)
        for i, s in enumerate(sampled):
            if plan.lineage is not None:
                reply_key = plan.lineage.reply_key(s.message)
                turn_keys = [reply_key, plan.lineage.input_key]
            else:
                reply_key = None
                turn_keys = [
                    token_key(plan.prompt_ids + s.token_ids),
                    token_input_key(plan.prompt_ids),
                ]
            stamp: dict[str, Any] = {}
            if i == 0:
                turn_keys.append(RESPONSE_KEY_PREFIX + response_id)
                if conversation.idempotency is not None:
                    turn_keys.append(IDEMPOTENCY_DONE + conversation.idempotency.key)
                    stamp = {
                        "idempotency": {
                            "fingerprint": conversation.idempotency.fingerprint,
                            "response_id": response_id,
                            "choices": len(sampled),
                        }
                    }
            keys.append(turn_keys)
            records.append(
                TurnRecord(
                    turn_id=0,
                    parent_id=plan.parent_id,
                    segment_start=plan.segment_start,
                    kind=plan.kind,
                    break_reason=plan.break_reason,
                    prompt_delta=plan.prompt_delta,
                    completion_ids=s.token_ids,
                    logprobs=[math.nan if lp is None else lp for lp in s.logprobs],
                    finish_reason=s.engine_finish,
                    stop_reason=s.stop_reason,
                    n_messages=plan.n_messages,
                    api=conversation.api,
                    weight_versions=s.weight_versions,
                    routed_experts=_routes_of(plan, s),
                    extra={"splice_ms": round(plan.splice_seconds * 1000, 3)}
                    | ({"reply_key": reply_key} if reply_key else {})
                    | ({"volatile": plan.volatile} if plan.volatile else {})
                    | ({"images": images} if images else {})
                    | cache
                    | stamp,
                )
            )
        try:
            ids = await self._append(plan, records, keys)
        except SessionNotFound:
            self._sessions.pop(plan.session.session_id, None)
            raise
        except SessionFinished:
            raise self._finished(plan.session.session_id) from None
        cache = self._records.get(plan.session.session_id)
        if cache is not None:
            _hold_stored(cache, plan.incarnation, records, ids)
            if plan.prompt_json:
                cache.tokens_json = {
                    turn_id: (
                        len(plan.prompt_ids) + len(s.token_ids),
                        _json_extend(plan.prompt_json, s.token_ids),
                    )
                    for s, turn_id in zip(sampled, ids, strict=True)
                }
        self.metrics.turns.labels(kind=plan.kind).inc(len(records))
        for version, count in turns_by_version(records).items():
            self.metrics.turns_by_weight_version.labels(version=version).inc(count)
        if plan.volatile:
            self.metrics.normalized_requests.inc()
        if cached_tokens is not None:
            self.metrics.prompt_tokens.inc(len(plan.prompt_ids))
            self.metrics.cached_prompt_tokens.inc(cached_tokens)
            self.metrics.stale_cache_turns.inc(
                sum(
                    stale_cache(plan.earlier, cached_tokens, record.weight_versions)
                    for record in records
                )
            )
        if plan.break_reason and plan.kind in ("rewrite",):
            self.metrics.segment_breaks.labels(reason=plan.break_reason).inc()
        self.metrics.splice_seconds.observe(plan.splice_seconds)
        return TurnResult(
            session_id=plan.session.session_id,
            prompt_ids=plan.prompt_ids,
            choices=[
                ChoiceResult(
                    index=s.index,
                    turn_id=turn_id,
                    message=s.message,
                    token_ids=s.token_ids,
                    logprobs=s.logprobs,
                    finish_reason=s.api_finish,
                    stop_reason=s.stop_reason,
                )
                for s, turn_id in zip(sampled, ids, strict=True)
            ],
            kind=plan.kind,
            break_reason=plan.break_reason,
            created=int(time.time()),
            model=self.config.model_name,
            response_id=response_id,
            parent_turn_id=plan.parent_id,
            return_token_ids=return_token_ids(conversation, plan.session),
        )

    async def _append(
        self, plan: Plan, records: list[TurnRecord], keys: list[list[str]]
    ) -> list[int]:
        """Store the turns unless an identical request (same input key) stored its turns
        since this one was planned (concurrent resends, a resend while the first was still
        generating, on any replica): then these turns are retries, siblings of that
        request's, never a second root or a second continuation."""
        session_id = plan.session.session_id
        # Only into the session the plan was made from: not one deleted and created again
        # meanwhile, whose turn ids restart (SessionNotFound).
        incarnation = plan.incarnation
        if plan.kind == "retry":
            return await self.store.append_turns(session_id, records, keys, incarnation=incarnation)
        try:
            return await self.store.append_turns(
                session_id, records, keys, unless_key=keys[0][1], incarnation=incarnation
            )
        except KeyTaken as taken:
            (winner,) = await self.store.get_turns(session_id, [taken.turn_id])
        same_prompt = winner is not None and (
            winner.parent_id,
            winner.segment_start,
            winner.prompt_delta,
        ) == (plan.parent_id, plan.segment_start, plan.prompt_delta)
        if same_prompt:
            assert winner is not None
            plan.kind = "retry"
            plan.break_reason = winner.break_reason
            for record in records:
                record.kind = "retry"
                record.break_reason = winner.break_reason
            self.metrics.retry_races.inc()
        return await self.store.append_turns(session_id, records, keys, incarnation=incarnation)


def _hold_stored(
    cache: RecordCache, incarnation: str | None, records: list[TurnRecord], ids: list[int]
) -> None:
    """Keep the turns just stored in the session's record cache, as the store would decode
    them (their ids, logprobs as the float32 the codec keeps): the next turn's lookup then
    neither transfers nor decodes its parent. Only while the cache still holds the
    incarnation the plan read; a turn with MoE routes is left to the store (the codec
    narrows their integer type)."""
    if incarnation is None or cache.incarnation != incarnation:
        return
    for record, turn_id in zip(records, ids, strict=True):
        if record.routed_experts is None:
            cache.records[turn_id] = replace(
                record, turn_id=turn_id, logprobs=stored_logprobs(record.logprobs)
            )


def _earlier(plan: Plan, found: LookupResult) -> list[TurnRecord]:
    """The segment's turns before the planned one (none when it starts a segment)."""
    if plan.segment_start:
        return []
    path = found.retry_path if plan.kind == "retry" else found.parent_path
    start = max((i for i, t in enumerate(path) if t.segment_start), default=0)
    return path[start:]


def _key_reused(key: str) -> Refused:
    return Refused(
        422,
        f"Idempotency-Key {key!r} was used with a different request body",
        kind="idempotency_key_reused",
        param="Idempotency-Key",
    )


def replay_events(result: TurnResult) -> list[StreamEvent]:
    """A stored reply as the stream events that first produced it (an Idempotency-Key
    resend of a streamed request)."""
    events: list[StreamEvent] = [
        StreamStarted(
            session_id=result.session_id,
            prompt_ids=result.prompt_ids,
            kind=result.kind,
            break_reason=result.break_reason,
            created=result.created,
            model=result.model,
            n=len(result.choices),
            response_id=result.response_id,
            return_token_ids=result.return_token_ids,
        )
    ]
    for choice in result.choices:
        events.append(
            ChoiceDelta(
                index=choice.index,
                token_ids=choice.token_ids,
                logprobs=choice.logprobs,
                content=choice.message.content or "",
                reasoning=choice.message.reasoning or "",
            )
        )
        events.append(
            ChoiceFinished(
                index=choice.index, message=choice.message, finish_reason=choice.finish_reason
            )
        )
    events.append(StreamFinished(result=result))
    return events


@dataclass(slots=True)
class _Sampled:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    engine_finish: str
    stop_reason: int | str | None
    message: Message
    api_finish: str
    weight_versions: list[WeightSpan]
    routed_experts: np.ndarray | None = None


def _ask_for_routes(plan: Plan) -> None:
    if plan.session.routed_experts:
        # vLLM then reports only the positions no earlier turn of the segment holds.
        plan.sampling["routed_experts_prompt_start"] = plan.route_start


def _routes_of(plan: Plan, sampled: _Sampled) -> RoutedExperts | None:
    """The sampled choice's routes, if the session wants them and they cover exactly the
    positions this turn adds (anything else would misalign them: not stored)."""
    if not plan.session.routed_experts or sampled.routed_experts is None:
        return None
    expected = len(plan.prompt_ids) + len(sampled.token_ids) - 1 - plan.route_start
    if sampled.routed_experts.shape[0] != expected:
        logger.warning(
            "engine routed_experts cover %d positions, the turn adds %d: not stored",
            sampled.routed_experts.shape[0],
            expected,
        )
        return None
    return RoutedExperts(plan.route_start, sampled.routed_experts)


def return_token_ids(conversation: Conversation, session: SessionMeta) -> bool:
    """The request's choice, else the session's, else the API's: token-ID clients
    (`/v1/completions`) get them, the harness APIs do not (the trajectory export is where a
    trainer reads tokens)."""
    if conversation.return_token_ids is not None:
        return conversation.return_token_ids
    if session.return_token_ids is not None:
        return session.return_token_ids
    return conversation.api == "completions"


def volatile_parts(conversation: Conversation, rules: list[Rule]) -> list[str]:
    """What normalisation ignored, so the difference is on record (a few, truncated)."""
    found: list[str] = []
    for message in conversation.messages:
        for rule in rules:
            matches = rule.finditer(message.content or "")
            for match in itertools.islice(matches, MAX_RULE_MATCHES):
                part = match.group(0)[:200]
                if part not in found:
                    found.append(part)
                if len(found) >= 8:
                    return found
    return found


def _json_extend(array_json: bytes, tokens: list[int]) -> bytes:
    """The JSON array `array_json` with `tokens` appended (a copy of the bytes, no decoding)."""
    if not tokens:
        return array_json
    if array_json == b"[]":
        return orjson.dumps(tokens)
    return array_json[:-1] + b"," + orjson.dumps(tokens)[1:]


def token_key(tokens: list[int]) -> str:
    """Names a token sequence (a turn's prompt + sampled tokens) for token-ID clients."""
    return "t:" + hashlib.blake2b(array("I", tokens).tobytes(), digest_size=12).hexdigest()


def token_prefix_keys(tokens: list[int], cuts: list[int]) -> list[str]:
    """`token_key(tokens[:cut])` for every cut, in one pass over the tokens."""
    data = array("I", tokens).tobytes()
    running = hashlib.blake2b(digest_size=12)
    keys: list[str] = []
    done = 0
    for cut in cuts:
        running.update(data[4 * done : 4 * cut])
        done = cut
        keys.append("t:" + running.copy().hexdigest())
    return keys


def token_input_key(tokens: list[int]) -> str:
    return "ti:" + token_key(tokens)[2:]


def token_cut_points(prompt_ids: list[int], stop_ids: set[int]) -> list[int]:
    """Where in a token prompt a stored turn can end, shallowest first: after an
    end-of-turn token, or before one (a truncated turn the client closed itself)."""
    cuts: list[int] = []
    for i, token in enumerate(prompt_ids):
        if token in stop_ids:
            if i > 0 and (not cuts or cuts[-1] != i):
                cuts.append(i)
            cuts.append(i + 1)
    return [c for c in cuts if c < len(prompt_ids)]


def _tokens_through(path: list[TurnRecord]) -> list[int]:
    """Prompt + completion tokens of the last turn of `path`, from its segment's start."""
    start = max(i for i, t in enumerate(path) if t.segment_start or i == 0)
    tokens: list[int] = []
    for turn in path[start:]:
        tokens.extend(turn.prompt_delta)
        tokens.extend(turn.completion_ids)
    return tokens


def _prompt_of(parent_path: list[TurnRecord], turn: TurnRecord) -> list[int]:
    if turn.segment_start or not parent_path:
        return list(turn.prompt_delta)
    return _tokens_through(parent_path) + turn.prompt_delta
