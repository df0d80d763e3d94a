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
import hashlib
import itertools
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

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
from session_server.images import (
    ImageInput,
    PlaceholderRun,
    PromptImage,
    VisionSpec,
    place,
    prompt_image,
    read_image,
    scan_runs,
)
from session_server.metrics import Metrics
from session_server.sampling import build_sampling
from session_server.service_config import ServiceConfig
from session_server.splice import BRIDGE_CONTEXT_TOKENS, ChatModel
from session_server.store.base import (
    LookupResult,
    SessionMeta,
    SessionStore,
    TurnRecord,
)
from session_server.turns.errors import ProofFailed, session_finished
from session_server.turns.part import CorePart
from session_server.turns.policy import PolicyLag
from session_server.turns.sessions import Recreated, SessionCache

RESPONSE_KEY_PREFIX = "resp:"


OFF_LOOP_CHARS = 16_384


OFF_LOOP_MESSAGES = 2_048


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
    delta_images: list[PromptImage] | None = None
    """The images `prompt_delta` adds, in order, where the splice knows them (an extend or
    fork: the bridge's; a retry: the retried turn's); None: the request's images."""
    image_runs: list[PlaceholderRun] = field(default_factory=list)
    """Every image placeholder run of `prompt_ids`, in order (offsets in `prompt_ids`)."""
    images: dict[str, ImageInput] = field(default_factory=dict)
    """The bytes of each image of the prompt by SHA-256: from the request, else from the
    session's stored images (a client that did not resend them)."""

    @property
    def route_start(self) -> int:
        """The first segment position whose experts this turn's request reports: its
        parent's last sampled token, which no earlier request forwarded (0 for a segment's
        first turn)."""
        if self.segment_start:
            return 0
        return len(self.prompt_ids) - len(self.prompt_delta) - 1


class TurnPlanner(CorePart):
    """Decides what a request is (first, extend, fork, retry, rewrite) and the token
    prompt it is sent with, from one lookup of the stored turns."""

    def __init__(
        self,
        store: SessionStore,
        model: ChatModel,
        config: ServiceConfig,
        sessions: SessionCache,
        policy: PolicyLag,
        metrics: Metrics,
    ) -> None:
        super().__init__(store, model, config, sessions, metrics)
        self.policy = policy

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
        return await self.sessions.retry_fresh(
            session_id,
            lambda: self._plan_messages(session_id, conversation, many, chars > OFF_LOOP_CHARS),
        )

    def _template_kwargs(self, meta: SessionMeta, conversation: Conversation) -> dict[str, Any]:
        """What the chat template renders with: the request's `chat_template_kwargs` over
        the session's, key by key; then Messages' `thinking` as `enable_thinking` where the
        template reads it and neither set it (a trainer's session default wins over the
        `thinking` a harness such as Claude Code sends on every request)."""
        kwargs = {**(meta.chat_template_kwargs or {}), **conversation.template_kwargs}
        if (
            conversation.thinking is not None
            and "enable_thinking" not in kwargs
            and self.model.template_reads("enable_thinking")
        ):
            kwargs["enable_thinking"] = conversation.thinking
        return kwargs

    def _check_current(self, meta: SessionMeta, found: LookupResult) -> None:
        """Before anything is generated: the session the lookup read is the one `meta`
        describes (not deleted and created again since it was cached), and it is not
        finished (a finished rollout is final)."""
        if found.incarnation != meta.incarnation:
            raise Recreated(meta.session_id)
        if found.finished:
            self.metrics.rejections.labels(reason="session_finished").inc()
            raise session_finished(meta.session_id)

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
        meta = await self.sessions.get(session_id)
        conversation.template_kwargs = self._template_kwargs(meta, conversation)
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
                known=self.sessions.records(session_id),
            )
        self._check_current(meta, found)
        self.policy.check(found)
        plan = (
            await asyncio.to_thread(self._classify, meta, conversation, keys, found)
            if many or (long and not found.parent_path and found.retry_of is None)
            else self._classify(meta, conversation, keys, found)
        )
        plan.earlier = _earlier(plan, found)
        plan.incarnation = found.incarnation
        await self._place_images(session_id, plan, conversation, found)
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
        return await self.sessions.retry_fresh(
            session_id, lambda: self._plan_tokens(session_id, prompt_ids, conversation)
        )

    async def _plan_tokens(
        self, session_id: str, prompt_ids: list[int], conversation: Conversation
    ) -> Plan:
        started = time.perf_counter()
        if self.model.vision is not None and scan_runs(prompt_ids, self.model.vision):
            raise ConversationError(
                "a token-ID prompt cannot hold image placeholders (no image comes with it); "
                "send images through chat, messages or responses",
                param="prompt",
            )
        meta = await self.sessions.get(session_id)
        cuts = token_cut_points(prompt_ids, set(self.model.stop_token_ids))
        cut_keys = token_prefix_keys(prompt_ids, cuts)
        found = await self.store.lookup(
            session_id,
            cut_keys,
            token_input_key(prompt_ids),
            known=self.sessions.records(session_id),
        )
        self._check_current(meta, found)
        self.policy.check(found)
        n = len(prompt_ids)
        if found.retry_of is not None:
            plan = self._retry(meta, conversation, None, prompt_ids, found.retry_of)
        elif found.parent_path and found.matched_key_index is not None:
            cut = cuts[found.matched_key_index]
            stored = tokens_through(found.parent_path)
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

    async def _place_images(
        self, session_id: str, plan: Plan, conversation: Conversation, found: LookupResult
    ) -> None:
        """Where each image of the prompt is and its bytes: the segment's earlier images from
        their turns' records, the new ones from the splice (or the request, for a prompt
        rendered whole). An image the request did not resend is read from the session's
        stored images; one that is no longer there is a 400 naming it (nothing is sent)."""
        vision = self.model.vision
        if vision is None:
            return
        request = [image for m in conversation.messages for image in m.images]
        sent = {image.sha256: image for image in request}
        earlier = [image for turn in plan.earlier for image in _recorded_images(turn)]
        delta = plan.delta_images
        if delta is None:
            delta = [prompt_image(image, vision.spec) for image in request]
        wanted = earlier + delta
        if not wanted:
            return
        plan.image_runs = place(plan.prompt_ids, wanted, vision)
        missing = list(dict.fromkeys(i.sha256 for i in wanted if i.sha256 not in sent))
        kept = await self.store.get_images(session_id, missing) if missing else {}
        lost = [sha for sha in missing if sha not in kept]
        if lost:
            raise ConversationError(
                f"image {lost[0]} of this session's earlier turns is no longer stored (it "
                f"expired or was never kept){f' nor {len(lost) - 1} more' if len(lost) > 1 else ''}"
                "; send the conversation again with its images",
                param=("previous_response_id" if conversation.previous_response_id else "messages"),
            )
        plan.images = {
            sha: sent[sha] if sha in sent else read_image(kept[sha])
            for sha in dict.fromkeys(i.sha256 for i in wanted)
        }

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
            session_id, [key], None, known=self.sessions.records(session_id)
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
            prompt = prompt_of(found.retry_path, found.retry_of)
            return self._retry(meta, conversation, keys, prompt, found.retry_of)
        if found.parent_path:
            parent = found.parent_path[-1]
            stored = tokens_through(found.parent_path)
            prompt_end = len(stored) - len(parent.completion_ids)
            if conversation.previous_response_id:
                # The request holds only what follows the stored turn: where the template is
                # the reference for the new messages, it renders them after a stand-in for
                # the history ending in the stored reply (as sampled, parsed again).
                new_messages = messages
                history = self.model.stand_in_history(
                    stored[max(0, prompt_end - BRIDGE_CONTEXT_TOKENS) : prompt_end],
                    parent.completion_ids,
                    parent.finish_reason,
                    new_messages,
                    conversation.tools,
                    conversation.template_kwargs,
                )
            else:
                assert found.matched_key_index is not None
                matched = keys.assistant_positions[found.matched_key_index]
                history = messages[: matched + 1]
                new_messages = messages[matched + 1 :]
            bridge = self.model.bridge(
                stored[max(0, prompt_end - BRIDGE_CONTEXT_TOKENS) : prompt_end],
                parent.completion_ids,
                parent.finish_reason,
                history,
                new_messages,
                conversation.tools,
                conversation.template_kwargs,
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
                if self.model.vision is not None:
                    plan.delta_images = [
                        _known(run.sha256, messages, self.model.vision.spec) for run in bridge.runs
                    ]
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
        cache = self.sessions.held(session_id)  # no reordering: this may run off the loop
        entry = cache.tokens_json.get(parent_id) if cache is not None else None
        if entry is None or entry[0] != len(stored):
            return b""
        if not entry[1].endswith(orjson.dumps(stored[-16:])[1:]):
            return b""
        return json_extend(entry[1], delta)

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
                    conversation.template_kwargs,
                )
                if bridge.delta is not None:
                    return [
                        *message.prompt_token_ids,
                        *message.generation_token_ids,
                        *bridge.delta,
                    ]
            break
        return self.model.render_prompt(messages, conversation.tools, conversation.template_kwargs)

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
        plan = self._plan(
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
        plan.delta_images = _recorded_images(retry)
        return plan

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


def _earlier(plan: Plan, found: LookupResult) -> list[TurnRecord]:
    """The segment's turns before the planned one (none when it starts a segment)."""
    if plan.segment_start:
        return []
    path = found.retry_path if plan.kind == "retry" else found.parent_path
    start = max((i for i, t in enumerate(path) if t.segment_start), default=0)
    return path[start:]


def _ask_for_routes(plan: Plan) -> None:
    if plan.session.routed_experts:
        # vLLM then reports only the positions no earlier turn of the segment holds.
        plan.sampling["routed_experts_prompt_start"] = plan.route_start


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


def json_extend(array_json: bytes, tokens: list[int]) -> bytes:
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


def tokens_through(path: list[TurnRecord]) -> list[int]:
    """Prompt + completion tokens of the last turn of `path`, from its segment's start."""
    start = max(i for i, t in enumerate(path) if t.segment_start or i == 0)
    tokens: list[int] = []
    for turn in path[start:]:
        tokens.extend(turn.prompt_delta)
        tokens.extend(turn.completion_ids)
    return tokens


def prompt_of(parent_path: list[TurnRecord], turn: TurnRecord) -> list[int]:
    if turn.segment_start or not parent_path:
        return list(turn.prompt_delta)
    return tokens_through(parent_path) + turn.prompt_delta


def _recorded_images(turn: TurnRecord) -> list[PromptImage]:
    """The images a stored turn's prompt delta added (its record's `extra.images`)."""
    return [
        PromptImage(i["sha256"], i["length"], i["width"], i["height"])
        for i in turn.extra.get("images", ())
    ]


def _known(sha256: str, messages: list[Message], spec: VisionSpec) -> PromptImage:
    image = next(i for m in messages for i in m.images if i.sha256 == sha256)
    return prompt_image(image, spec)
