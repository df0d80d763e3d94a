"""Storing what was sampled: the turn records of one request, appended atomically (all or
nothing) into the session the plan was made from, then held for the next lookup."""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from session_server.conversation import (
    Conversation,
    Message,
)
from session_server.results import (
    ChoiceResult,
    TurnResult,
)
from session_server.store.base import (
    IDEMPOTENCY_DONE,
    KeyTaken,
    RecordCache,
    RoutedExperts,
    SessionFinished,
    SessionMeta,
    SessionNotFound,
    TurnRecord,
    WeightSpan,
)
from session_server.store.codec import stored_logprobs
from session_server.turns.errors import session_finished
from session_server.turns.part import CorePart
from session_server.turns.planning import (
    RESPONSE_KEY_PREFIX,
    Plan,
    json_extend,
    token_input_key,
    token_key,
)
from session_server.versions import (
    stale_cache,
    turns_by_version,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Sampled:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    engine_finish: str
    stop_reason: int | str | None
    message: Message
    api_finish: str
    weight_versions: list[WeightSpan]
    routed_experts: np.ndarray | None = None


class TurnRecorder(CorePart):
    """Stores a request's sampled choices as turns and keeps them for the next lookup."""

    async def record(
        self,
        plan: Plan,
        conversation: Conversation,
        sampled: list[Sampled],
        *,
        response_id: str | None = None,
        cached_tokens: int | None = None,
    ) -> TurnResult:
        response_id = response_id or uuid.uuid4().hex
        cache: dict[str, Any] = {} if cached_tokens is None else {"cached_tokens": cached_tokens}
        records: list[TurnRecord] = []
        keys: list[list[str]] = []
        images = await self._keep_images(plan)
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
            self.sessions.drop(plan.session.session_id)
            raise
        except SessionFinished:
            self.metrics.rejections.labels(reason="session_finished").inc()
            raise session_finished(plan.session.session_id) from None
        cache = self.sessions.held(plan.session.session_id)
        if cache is not None:
            _hold_stored(cache, plan.incarnation, records, ids)
            if plan.prompt_json:
                cache.tokens_json = {
                    turn_id: (
                        len(plan.prompt_ids) + len(s.token_ids),
                        json_extend(plan.prompt_json, s.token_ids),
                    )
                    for s, turn_id in zip(sampled, ids, strict=True)
                }
        self.metrics.turns.labels(kind=plan.kind).inc(len(records))
        for version, count in turns_by_version(records).items():
            self.metrics.turns_by_weight_version.labels(version=version).inc(count)
        for record in records:
            for span in record.weight_versions:
                self.metrics.sampled_tokens_by_weight_version.labels(version=span.version).inc(
                    span.end - span.start
                )
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

    async def _keep_images(self, plan: Plan) -> list[dict[str, Any]]:
        """Store the images this turn's prompt delta added (once per hash per session; the
        earlier ones were stored by the turns that added them) and describe them, offsets
        relative to the delta (the export shifts them into segment coordinates)."""
        if not plan.image_runs:
            return []
        delta_start = len(plan.prompt_ids) - len(plan.prompt_delta)
        added = [run for run in plan.image_runs if run.offset >= delta_start]
        # Called with no new image too: the Redis store refreshes the images' time to live.
        await self.store.put_images(
            plan.session.session_id, {run.sha256: plan.images[run.sha256].data for run in added}
        )
        return [
            {
                "sha256": run.sha256,
                "offset": run.offset - delta_start,
                "length": run.length,
                "width": plan.images[run.sha256].width,
                "height": plan.images[run.sha256].height,
            }
            for run in added
        ]


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


def _routes_of(plan: Plan, sampled: Sampled) -> RoutedExperts | None:
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
