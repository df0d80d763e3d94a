"""A turn served end to end: planned (`planning`), generated on the engine while an abort
can cut it (`flights`), recorded (`recording`), once per Idempotency-Key (`idempotency`).

Data flows one way: the API front-ends hand a `Conversation` to `TurnService`, which asks
the planner for a `Plan`, the engine client for tokens, and the recorder to store them; each
part reads the cached sessions (`sessions`), none calls back into the service."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import numpy as np
import orjson

from session_server.conversation import Conversation
from session_server.engines import EngineClient, EngineError, GenerationDelta
from session_server.images import ImageInput, collapse
from session_server.metrics import Metrics
from session_server.reply_split import ReplyStreamer
from session_server.results import (
    ChoiceDelta,
    ChoiceFinished,
    StreamEvent,
    StreamFinished,
    StreamStarted,
    TurnResult,
)
from session_server.service_config import ServiceConfig
from session_server.splice import ChatModel
from session_server.store.base import (
    Finish,
    SessionMeta,
    SessionStore,
    WeightSpan,
)
from session_server.turns.errors import Aborted, ProofFailed
from session_server.turns.flights import Cut, Flight, Flights
from session_server.turns.idempotency import IdempotencyClaims, replay_events
from session_server.turns.planning import Plan, TurnPlanner
from session_server.turns.policy import PolicyLag
from session_server.turns.recording import Sampled, TurnRecorder, return_token_ids
from session_server.turns.sessions import SessionCache
from session_server.versions import first_weight_version


class TurnService:
    """Serves a turn: plans it, generates it on the engine (cut by an abort), records it.
    The parts it composes each keep one kind of state: the cached sessions, the planner,
    the recorder, generations in flight, Idempotency-Key claims, the policy lag."""

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
        self.sessions = SessionCache(store, config)
        self.policy = PolicyLag(engine, config, metrics)
        self.planner = TurnPlanner(store, model, config, self.sessions, self.policy, metrics)
        self.recorder = TurnRecorder(store, model, config, self.sessions, metrics)
        self.flights = Flights(store, metrics)
        self.claims = IdempotencyClaims(store, model, config, self.sessions, metrics)

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

    async def abort(self, session_id: str) -> int:
        """Cut every generation of the session in flight (`Flights.abort`)."""
        return await self.flights.abort(session_id)

    async def complete(self, session_id: str, conversation: Conversation) -> TurnResult:
        return await self._complete_once(
            session_id, conversation, lambda: self.planner.plan(session_id, conversation)
        )

    def stream(self, session_id: str, conversation: Conversation) -> AsyncIterator[StreamEvent]:
        return self._stream_once(
            session_id, conversation, lambda: self.planner.plan(session_id, conversation)
        )

    async def complete_tokens(
        self, session_id: str, prompt_ids: list[int], conversation: Conversation
    ) -> TurnResult:
        """A client that sends the token prompt itself (`/v1/completions`)."""
        return await self._complete_once(
            session_id,
            conversation,
            lambda: self.planner.plan_tokens(session_id, prompt_ids, conversation),
        )

    def stream_tokens(
        self, session_id: str, prompt_ids: list[int], conversation: Conversation
    ) -> AsyncIterator[StreamEvent]:
        return self._stream_once(
            session_id,
            conversation,
            lambda: self.planner.plan_tokens(session_id, prompt_ids, conversation),
        )

    async def _complete_once(
        self, session_id: str, conversation: Conversation, plan: Callable[[], Awaitable[Plan]]
    ) -> TurnResult:
        claimed = await self.claims.claim(session_id, conversation)
        if isinstance(claimed, TurnResult):
            return claimed
        flight = self.flights.take_off(session_id, conversation.arrived)
        try:
            result = await self._complete(await plan(), conversation, flight)
        except BaseException:
            await self.claims.release(session_id, conversation, claimed)
            raise
        finally:
            self.flights.land(session_id, flight)
        self.claims.settled(session_id, conversation)
        return result

    async def _stream_once(
        self, session_id: str, conversation: Conversation, plan: Callable[[], Awaitable[Plan]]
    ) -> AsyncIterator[StreamEvent]:
        claimed = await self.claims.claim(session_id, conversation)
        if isinstance(claimed, TurnResult):
            for event in replay_events(claimed):
                yield event
            return
        stored = False
        flight = self.flights.take_off(session_id, conversation.arrived)
        try:
            planned = await plan()
            async with contextlib.aclosing(self._stream(planned, conversation, flight)) as events:
                async for event in events:
                    stored = stored or isinstance(event, StreamFinished)
                    yield event
        finally:
            self.flights.land(session_id, flight)
            if stored:
                self.claims.settled(session_id, conversation)
            else:
                await self.claims.release(session_id, conversation, claimed)

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
                Sampled(
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
        await self.recorder.record(plan, conversation, sampled)
        self.metrics.aborted_requests.inc()
        raise Aborted(plan.session.session_id)

    async def _complete(self, plan: Plan, conversation: Conversation, flight: Flight) -> TurnResult:
        session_id = plan.session.session_id
        sent, images = self._engine_prompt(plan, conversation)
        started = time.perf_counter()
        self.flights.unsent(session_id, flight)
        plan.prompt_json = plan.prompt_json or orjson.dumps(plan.prompt_ids)
        try:
            generation = await flight.run(
                self.engine.generate(
                    session_id,
                    sent,
                    plan.sampling,
                    reasoning_ended=reasoning_ended(conversation, plan.session),
                    images=images,
                    prompt_json=None if images else plan.prompt_json,
                )
            )
        except Cut:
            # vLLM returns nothing of a non-streamed request it aborted: the cut turn holds
            # no tokens (a streamed request keeps every token that arrived).
            await self._record_cut(plan, conversation, [[]] * conversation.n)
        finally:
            self.flights.land(session_id, flight)
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
        return await self.recorder.record(
            plan,
            conversation,
            [
                Sampled(
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
        self, plan: Plan, conversation: Conversation, flight: Flight
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
        self.flights.unsent(session_id, flight)
        plan.prompt_json = plan.prompt_json or orjson.dumps(plan.prompt_ids)
        engine_stream = self.engine.stream(
            session_id,
            sent,
            plan.sampling,
            reasoning_ended=reasoning_ended(conversation, plan.session),
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
        except Cut:
            # Closing the engine stream (above) closed its connection: vLLM stopped it.
            await self._record_cut(plan, conversation, tokens, logprobs, versions)
        finally:
            self.flights.land(session_id, flight)
        self.metrics.engine_seconds.observe(time.perf_counter() - started)
        if not announced:
            yield self._started(plan, conversation, response_id)
        sampled: list[Sampled] = []
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
                Sampled(
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
        result = await self.recorder.record(
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
        proof then compares with the stored one). The planner placed them
        (`Plan.image_runs`) and found each one's bytes, resent or stored."""
        if not plan.image_runs:
            return plan.prompt_ids, ()
        images = tuple(plan.images[run.sha256] for run in plan.image_runs)
        return collapse(plan.prompt_ids, plan.image_runs), images

    def _check_reply(
        self, plan: Plan, received: list[list[int]], index: int, token_ids: list[int]
    ) -> None:
        """`token_ids`, sent for choice `index` after `received[index]`, must be what the
        engine could sample for this request, else the reply is the engine's fault and
        nothing is stored: a negative token id failed the store's encoding (a 500), one past
        the model's output layer was stored, a stream past `max_tokens` was relayed without
        bound. (Ids past the tokenizer but inside the padded output layer are sampled, by a
        random model for one: they are what the engine sampled and are kept.)"""
        limit, vocab = plan.sampling["max_tokens"], self.model.output_size
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

    def _check_proof(self, plan: Plan, reported: list[int] | None) -> None:
        if reported is not None and reported != plan.prompt_ids:
            self.metrics.proof_failures.inc()
            raise ProofFailed(
                "the engine reports a prompt that differs from the spliced prompt "
                f"({len(reported)} vs {len(plan.prompt_ids)} tokens); nothing was stored"
            )


def reasoning_ended(conversation: Conversation, session: SessionMeta) -> bool | None:
    """The request's `reasoning_ended`, else the session's (None: the engine's default)."""
    if conversation.reasoning_ended is not None:
        return conversation.reasoning_ended
    return session.reasoning_ended
