"""Sessions as the trainer and the viewer see them: create, describe, finish, abort, delete,
list finished rollouts and groups, export them, and browse them.

The management API (`api/sessions.py`) and the viewer's data (`api/viewer.py`) parse their
requests and call `SessionService`; it decides and reads the store, and no API module
touches the store itself. Selection has one semantics for both: `batch.parse_selector` and
`batch.matches` (metadata compared as JSON text: `done=true` matches `{"done": true}`, a
missing key matches nothing).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from session_server import batch, export
from session_server.images import thumbnail_data_url
from session_server.keys import issue_session_key
from session_server.store.base import AlreadyFinished, Finish, SessionMeta, SessionNotFound
from session_server.turns.errors import Refused
from session_server.turns.service import TurnService

MAX_PAGE = 500
"""The most sessions one viewer page lists."""


def finish_json(finish: Finish | None) -> dict[str, Any] | None:
    """A finish as every management answer shows it."""
    if finish is None:
        return None
    return {
        "finished_at": finish.finished_at,
        "reward": finish.reward,
        "status": finish.status,
        "metadata": finish.metadata,
    }


def session_json(meta: SessionMeta) -> dict[str, Any]:
    """A session's settings as every management answer shows them."""
    return {
        "id": meta.session_id,
        "created_at": meta.created_at,
        "ttl_seconds": meta.ttl_seconds,
        "sampling": meta.sampling_overrides,
        "metadata": meta.metadata,
        "routed_experts": meta.routed_experts,
        "reasoning_ended": meta.reasoning_ended,
        "chat_template_kwargs": meta.chat_template_kwargs,
        "group": meta.group,
        "group_size": meta.group_size,
    }


def staleness(
    min_weight_version: float | None, stale: Literal["mask", "drop"]
) -> export.Staleness | None:
    """The export's staleness filter (None: every version is kept as sampled)."""
    if min_weight_version is None:
        return None
    if not math.isfinite(min_weight_version):
        raise Refused(400, "min_weight_version must be a finite number", param="min_weight_version")
    return export.Staleness(min_weight_version, stale)


def _not_found(session_id: str) -> Refused:
    return Refused(404, f"session {session_id!r} not found", param="session_id")


def _batch_refusal(error: batch.BatchError) -> Refused:
    return Refused(error.status, error.message, param=error.param)


class SessionService:
    """The management side of sessions; turns go through `TurnService`, which this composes
    (a finish cuts the session's turns in flight; a listing shows the policy lag)."""

    def __init__(self, turns: TurnService) -> None:
        self.turns = turns
        self.store = turns.store

    # --- one session ----------------------------------------------------------------

    async def create(
        self,
        session_id: str | None,
        *,
        ttl_seconds: int | None,
        sampling: dict[str, Any] | None,
        metadata: dict[str, Any] | None,
        normalization: list[dict[str, Any]] | None,
        return_token_ids: bool | None,
        routed_experts: bool | None,
        group: str | None,
        group_size: int | None,
        reasoning_ended: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[SessionMeta, str]:
        """A new session and its API key (shown once: the store keeps its digest only).
        `session_id` None: a random id. 409 if the id is taken."""
        if (group is None) != (group_size is None):
            raise Refused(400, "group and group_size go together", param="group_size")
        chosen = session_id or uuid.uuid4().hex
        if session_id and await self.store.get_session(chosen) is not None:
            raise Refused(409, f"session {chosen!r} already exists", param="id")
        api_key, key_hash = issue_session_key(chosen)
        meta = await self.turns.sessions.create(
            chosen,
            ttl_seconds=ttl_seconds if ttl_seconds is not None else -1,
            sampling_overrides=sampling,
            metadata=metadata,
            normalization=normalization,
            return_token_ids=return_token_ids,
            key_hash=key_hash,
            routed_experts=routed_experts,
            reasoning_ended=reasoning_ended,
            chat_template_kwargs=chat_template_kwargs,
            group=group,
            group_size=group_size,
        )
        if meta.key_hash != key_hash:  # created concurrently by another request: not ours
            raise Refused(409, f"session {chosen!r} already exists", param="id")
        return meta, api_key

    async def existing(self, session_id: str) -> SessionMeta:
        meta = await self.store.get_session(session_id)
        if meta is None:
            raise _not_found(session_id)
        return meta

    async def describe(self, session_id: str) -> dict[str, Any]:
        """The session's settings, finish, counters and policy versions."""
        meta = await self.existing(session_id)
        turns = await self.store.all_turns(session_id)
        finish = await self.store.get_finish(session_id)
        policy = self.turns.policy
        first_version, lag_exceeded = policy.policy_lag(turns[0] if turns else None)
        return {
            **session_json(meta),
            "finish": finish_json(finish),
            **export.summary(session_id, turns),
            "engine_weight_versions": policy.engine_versions(),
            "engine": {
                "kind": self.turns.engine.wire.kind,
                "lacks": list(self.turns.engine.wire.lacks),
            },
            "first_weight_version": first_version,
            "policy_lag_exceeded": lag_exceeded,
        }

    async def trajectory(
        self,
        session_id: str,
        stale_filter: export.Staleness | None,
        branches: export.Branches,
    ) -> dict[str, Any]:
        await self.existing(session_id)
        turns = await self.store.all_turns(session_id)
        return export.trajectory(session_id, turns, stale_filter, branches)

    async def image(self, session_id: str, sha256: str) -> bytes:
        await self.existing(session_id)
        data = await self.store.get_image(session_id, sha256.lower())
        if data is None:
            raise Refused(404, f"session {session_id!r} has no image {sha256!r}", param="sha256")
        return data

    async def delete(self, session_id: str) -> None:
        if not await self.turns.sessions.delete(session_id):
            raise _not_found(session_id)

    async def finish(
        self,
        session_id: str,
        *,
        reward: float | None = None,
        metadata: dict[str, Any] | None = None,
        status: str = "ok",
    ) -> tuple[Finish, int]:
        """Freeze the session (`TurnService.finish`); returns the finish and how many of its
        generations in flight here were cut. 409 if it is finished already (nothing cut)."""
        await self.existing(session_id)
        finish = Finish(
            finished_at=time.time(), reward=reward, metadata=metadata or {}, status=status
        )
        try:
            cut = await self.turns.finish(session_id, finish)
        except AlreadyFinished as exc:
            raise Refused(409, f"session {session_id!r} is already finished") from exc
        return finish, cut

    async def abort(self, session_id: str, *, finish: bool) -> tuple[int, Finish | None]:
        """Cut the session's generations in flight; with `finish`, freeze it first (racing
        another finish, it changes nothing and cuts nothing: 409)."""
        if finish:
            done, cut = await self.finish(
                session_id, metadata={"status": "aborted"}, status="aborted"
            )
            return cut, done
        await self.existing(session_id)
        if await self.store.get_finish(session_id) is not None:
            raise Refused(409, f"session {session_id!r} is finished; nothing to abort")
        return await self.turns.abort(session_id), None

    # --- finished rollouts and groups -------------------------------------------------

    async def finished(
        self,
        *,
        selector: str | None,
        since: float | None,
        until: float | None,
        limit: int,
        statuses: list[str] | None,
    ) -> list[dict[str, Any]]:
        """Finished sessions matching the selector and time range, oldest finish first, each
        with the policy lag from its first turn."""
        if not 1 <= limit <= 100_000:
            raise Refused(400, "limit must be between 1 and 100000", param="limit")
        try:
            found = await batch.select(
                self.store,
                selector=batch.parse_selector(selector),
                since=since,
                until=until,
                limit=limit,
            )
        except batch.BatchError as exc:
            raise _batch_refusal(exc) from exc
        return [
            {
                "id": sid,
                "metadata": meta.metadata,
                "group": meta.group,
                "finish": finish_json(finish),
                "first_weight_version": finish.first_weight_version,
                "policy_lag_exceeded": self.turns.policy.lag_exceeded(finish.first_weight_version),
            }
            for sid, meta, finish in batch.with_status(found, statuses)
        ]

    async def group_state(self, group_id: str) -> dict[str, Any]:
        found = await batch.groups(self.store, [group_id])
        if group_id not in found:
            raise Refused(404, f"group {group_id!r} not found", param="group")
        group = found[group_id]
        return {
            **group.state(),
            "members": [
                {"id": meta.session_id, "finish": finish_json(finish)}
                for meta, finish in group.members
            ],
        }

    async def export_selection(
        self,
        *,
        group: str | None,
        session_ids: list[str] | None,
        selector: str | None,
        since: float | None,
        until: float | None,
        limit: int,
        failed_members: batch.FailedMembers,
        statuses: list[str] | None,
    ) -> list[batch.Selected]:
        """The finished sessions an export takes, every one checked before the first row:
        a group, named sessions, or a selection; groups whole (`batch.whole_groups`)."""
        try:
            if group is not None:
                found = await batch.groups(self.store, [group])
                if group not in found:
                    raise Refused(404, f"group {group!r} not found", param="group")
                selected = found[group].finished
            elif session_ids is not None:
                selected = await batch.named(self.store, session_ids)
            else:
                selected = await batch.select(
                    self.store,
                    selector=batch.parse_selector(selector),
                    since=since,
                    until=until,
                    limit=limit,
                )
            selected = await batch.whole_groups(
                self.store,
                selected,
                failed_members=failed_members,
                strict=group is not None or session_ids is not None,
            )
        except batch.BatchError as exc:
            raise _batch_refusal(exc) from exc
        selected = batch.with_status(selected, statuses)
        if not selected:
            raise Refused(404, "no finished session matches this export", param="selector")
        return selected

    async def export_lines(
        self,
        selected: list[batch.Selected],
        stale_filter: export.Staleness | None,
        branches: export.Branches,
    ) -> AsyncIterator[bytes]:
        """The export as JSON lines, one per segment; a session deleted while the export
        streams ends it with an `{"error": ...}` line."""
        try:
            async for row in batch.rows(self.store, selected, stale_filter, branches):
                row["policy_lag_exceeded"] = self.turns.policy.lag_exceeded(
                    row["first_weight_version"]
                )
                yield json.dumps(row, separators=(",", ":")).encode() + b"\n"
        except SessionNotFound as exc:
            error = {"message": f"session {exc.args[0]!r} was deleted during the export"}
            yield json.dumps({"error": error}).encode() + b"\n"

    # --- the viewer -----------------------------------------------------------------------

    async def page(
        self,
        *,
        offset: int,
        limit: int,
        q: str | None,
        metadata: str | None,
        state: Literal["running", "finished"] | None,
    ) -> dict[str, Any]:
        """A page of sessions, newest first: counters from the store, no turn records read."""
        if offset < 0 or not 1 <= limit <= MAX_PAGE:
            raise Refused(400, f"offset >= 0 and 1 <= limit <= {MAX_PAGE}", param="limit")
        try:
            wanted = batch.parse_selector(metadata)
        except batch.BatchError as exc:
            raise Refused(exc.status, exc.message, param="metadata") from exc
        rows = await self.store.list_sessions()
        finishes = {
            sid: finish for sid, _meta, finish in await self.store.list_finished(limit=len(rows))
        }
        matching = [
            (meta, counters)
            for meta, counters in rows
            if (not q or q in meta.session_id)
            and batch.matches(meta.metadata, wanted)
            and (state is None or (meta.session_id in finishes) == (state == "finished"))
        ]
        matching.sort(key=lambda row: (-row[0].created_at, row[0].session_id))
        return {
            "total": len(matching),
            "offset": offset,
            "limit": limit,
            "sessions": [
                {
                    "id": meta.session_id,
                    "created_at": meta.created_at,
                    "metadata": meta.metadata,
                    "turns": counters.turns,
                    "segments": counters.segments,
                    "breaks": counters.breaks,
                    "tokens": counters.tokens,
                    "state": "finished" if meta.session_id in finishes else "running",
                    "reward": finish.reward if (finish := finishes.get(meta.session_id)) else None,
                }
                for meta, counters in matching[offset : offset + limit]
            ],
        }

    async def view(self, session_id: str) -> dict[str, Any]:
        """What the viewer's session page draws: the summary, the whole turn tree, and every
        branch's segments with each token's decoded piece, whether it is a special token,
        and each image's placeholder run with a thumbnail."""
        meta = await self.existing(session_id)
        turns = await self.store.all_turns(session_id)
        data = export.trajectory(session_id, turns)
        tokenizer = self.turns.model.tokenizer
        special = tokenizer.special_token_ids
        thumbnails: dict[str, str | None] = {}

        async def thumbnail_of(sha256: str) -> str | None:
            if sha256 not in thumbnails:
                image = await self.store.get_image(session_id, sha256)
                thumbnails[sha256] = None if image is None else thumbnail_data_url(image)
            return thumbnails[sha256]

        for branch in data["branches"]:
            for segment in branch["segments"]:
                ids = segment["token_ids"]
                segment["pieces"] = tokenizer.pieces(ids)
                segment["special"] = [1 if t in special else 0 for t in ids]
                # Each image's placeholder run is drawn as one block with a small thumbnail.
                segment["images"] = [
                    {**image, "thumbnail": await thumbnail_of(image["sha256"])}
                    for turn in segment["turns"]
                    for image in turn.get("images", [])
                ]
        finish = await self.store.get_finish(session_id)
        return {
            "id": session_id,
            "created_at": meta.created_at,
            "metadata": meta.metadata,
            "model": self.turns.config.model_name,
            "state": "finished" if finish else "running",
            "reward": finish.reward if finish else None,
            **export.summary(session_id, turns),
            "turn_tree": [
                {
                    "turn_id": t.turn_id,
                    "parent_id": t.parent_id,
                    "kind": t.kind,
                    "api": t.api,
                    "break_reason": t.break_reason,
                    "finish_reason": t.finish_reason,
                    "created_at": t.created_at,
                    "completion_tokens": len(t.completion_ids),
                }
                for t in turns
            ],
            "branches": data["branches"],
        }
