"""Idempotency-Key: the first request holding a key generates, a resend waits for it (here
or on another server) and gets the same stored reply, rebuilt from its turns."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from session_server.conversation import Conversation
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
from session_server.service_config import ServiceConfig
from session_server.splice import ChatModel
from session_server.store.base import (
    IDEMPOTENCY_DONE,
    SessionNotFound,
    SessionStore,
)
from session_server.turns.errors import Refused
from session_server.turns.part import CorePart
from session_server.turns.planning import prompt_of
from session_server.turns.recording import return_token_ids
from session_server.turns.sessions import SessionCache

logger = logging.getLogger(__name__)


class IdempotencyClaims(CorePart):
    """Who holds each Idempotency-Key, and the stored replies resends get."""

    def __init__(
        self,
        store: SessionStore,
        model: ChatModel,
        config: ServiceConfig,
        sessions: SessionCache,
        metrics: Metrics,
    ) -> None:
        super().__init__(store, model, config, sessions, metrics)
        # (session, Idempotency-Key) -> set when this process's request holding it ends, so
        # a resend here wakes at once (resends through other replicas poll the store).
        self._claims: dict[tuple[str, str], asyncio.Event] = {}

    async def claim(self, session_id: str, conversation: Conversation) -> TurnResult | str | None:
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
            await self.sessions.get(session_id)
            try:
                claim = await self.store.claim_idempotency(
                    session_id,
                    idem.key,
                    idem.fingerprint,
                    owner=owner,
                    stale_after_s=self.config.idempotency_stale_s,
                )
            except SessionNotFound:  # deleted behind the cached metadata
                self.sessions.forget(session_id)
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

    def settled(self, session_id: str, conversation: Conversation) -> None:
        if conversation.idempotency is not None:
            event = self._claims.pop((session_id, conversation.idempotency.key), None)
            if event is not None:
                event.set()

    async def release(
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
            self.settled(session_id, conversation)

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
            known=self.sessions.records(session_id),
        )
        first = found.parent_path[-1]
        stamp = first.extra.get("idempotency") or {}
        if stamp.get("fingerprint") != conversation.idempotency.fingerprint:
            raise _key_reused(conversation.idempotency.key)
        n = int(stamp.get("choices", 1))
        rest = await self.store.get_turns(session_id, list(range(turn_id + 1, turn_id + n)))
        turns = [first, *(t for t in rest if t is not None)]
        prompt = prompt_of(found.parent_path[:-1], first)
        meta = await self.sessions.get(session_id)
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
