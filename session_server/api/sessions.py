"""Session management, finished rollouts and trajectory export (single and batch)."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from session_server import batch, export
from session_server.api import turn_service
from session_server.api.auth import issue_session_key
from session_server.api.errors import APIError
from session_server.api.session_ids import SESSION_ID_PATTERN, check_session_id
from session_server.images import image_media_type
from session_server.store.base import (
    FINISH_STATUSES,
    AlreadyFinished,
    Finish,
    FinishStatus,
    SessionNotFound,
)

router = APIRouter()


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN.pattern)
    sampling: dict[str, Any] | None = None
    """Sampling overrides that win over whatever the harness sends (vLLM names)."""
    metadata: dict[str, Any] | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    normalization: list[dict[str, Any]] | None = None
    """Volatile-prompt rules: [{"pattern": RE2 regex}]; matches are ignored when comparing
    history. Off by default: see docs/harnesses.md for the trade-off."""
    return_token_ids: bool | None = None
    """Replies carry `prompt_token_ids` / `token_ids` unless a request says otherwise
    (default: off for Chat Completions, Responses and Messages, on for token-ID completions;
    the trajectory export always has the tokens)."""
    routed_experts: bool | None = None
    """MoE routing replay: store each turn's expert routes (default: the server's
    --routed-experts setting). The engine needs --enable-return-routed-experts."""
    group: str | None = Field(default=None, pattern=SESSION_ID_PATTERN.pattern)
    """The rollout group (the G samples of one prompt); needs `group_size`."""
    group_size: int | None = Field(default=None, ge=1, le=100_000)
    """How many sessions the group has; the batch export takes the group once that many
    are finished."""


def _urls(request: Request, session_id: str) -> dict[str, str]:
    base = str(request.base_url).rstrip("/")
    return {
        "openai_base_url": f"{base}/sessions/{session_id}/v1",
        "anthropic_base_url": f"{base}/sessions/{session_id}",
    }


@router.post("/sessions", status_code=201)
async def create_session(request: Request, body: CreateSession | None = None) -> dict[str, Any]:
    body = body or CreateSession()
    if (body.group is None) != (body.group_size is None):
        raise APIError(400, "group and group_size go together", param="group_size")
    service = turn_service(request)
    session_id = body.id or uuid.uuid4().hex
    if body.id and await service.store.get_session(session_id) is not None:
        raise APIError(409, f"session {session_id!r} already exists", param="id")
    api_key, key_hash = issue_session_key(session_id)
    meta = await service.sessions.create(
        session_id,
        ttl_seconds=body.ttl_seconds if body.ttl_seconds is not None else -1,
        sampling_overrides=body.sampling,
        metadata=body.metadata,
        normalization=body.normalization,
        return_token_ids=body.return_token_ids,
        key_hash=key_hash,
        routed_experts=body.routed_experts,
        group=body.group,
        group_size=body.group_size,
    )
    if meta.key_hash != key_hash:  # created concurrently by another request: not ours
        raise APIError(409, f"session {session_id!r} already exists", param="id")
    return {
        "id": meta.session_id,
        "created_at": meta.created_at,
        "ttl_seconds": meta.ttl_seconds,
        "sampling": meta.sampling_overrides,
        "metadata": meta.metadata,
        "routed_experts": meta.routed_experts,
        "group": meta.group,
        "group_size": meta.group_size,
        **_urls(request, meta.session_id),
        # The only time the key is shown: the store keeps its digest only.
        "api_key": api_key,
    }


async def _existing(request: Request, session_id: str) -> Any:
    check_session_id(session_id)
    meta = await turn_service(request).store.get_session(session_id)
    if meta is None:
        raise APIError(404, f"session {session_id!r} not found", param="session_id")
    return meta


def _finish_json(finish: Finish | None) -> dict[str, Any] | None:
    if finish is None:
        return None
    return {
        "finished_at": finish.finished_at,
        "reward": finish.reward,
        "status": finish.status,
        "metadata": finish.metadata,
    }


def _staleness(
    min_weight_version: float | None, stale: Literal["mask", "drop"]
) -> export.Staleness | None:
    if min_weight_version is None:
        return None
    if not math.isfinite(min_weight_version):
        raise APIError(
            400, "min_weight_version must be a finite number", param="min_weight_version"
        )
    return export.Staleness(min_weight_version, stale)


def _batch_error(error: batch.BatchError) -> APIError:
    return APIError(error.status, error.message, param=error.param)


class FinishSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = Field(default=None, allow_inf_nan=False, strict=True)
    """A finite JSON number: `true` or `"1.0"` is refused, not read as 1.0."""
    metadata: dict[str, Any] | None = None
    status: FinishStatus = "ok"
    """`ok`, or why the rollout failed (a group holds or drops its failed members)."""


class ExportBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_ids: list[str] | None = Field(default=None, min_length=1)
    """Export exactly these (each must be finished); otherwise select by the fields below."""
    selector: str | None = None
    """`key=value,...` over the session metadata given at creation."""
    since: float | None = None
    """Finished at or after this Unix time."""
    until: float | None = None
    limit: int = Field(default=1000, ge=1, le=100_000)
    min_weight_version: float | None = None
    stale: Literal["mask", "drop"] = "mask"
    group: str | None = Field(default=None, pattern=SESSION_ID_PATTERN.pattern)
    """Export this group (409 while it runs or is held)."""
    status: list[FinishStatus] | None = Field(default=None, min_length=1)
    """Only sessions finished with one of these statuses (after the group rules)."""
    failed_members: batch.FailedMembers = "hold"
    """A complete group with a failed member: held back whole ("hold"), or exported
    without its failed members ("drop")."""
    branches: export.Branches = "all"
    """`last`: per session only the path to its most recently stored turn."""


@router.get("/sessions")
async def list_sessions(
    request: Request,
    finished: bool = True,
    selector: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int = 1000,
    status: str | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    """Finished sessions (the only ones listed: a listing of running ones would need an
    index written on every turn), each with `first_weight_version` and
    `policy_lag_exceeded`, or with `group`, that group's state and every member."""
    if group is not None:
        return await _group_state(request, group)
    if not finished:
        raise APIError(
            400, "only finished sessions can be listed (finished=true)", param="finished"
        )
    if not 1 <= limit <= 100_000:
        raise APIError(400, "limit must be between 1 and 100000", param="limit")
    try:
        found = await batch.select(
            turn_service(request).store,
            selector=batch.parse_selector(selector),
            since=since,
            until=until,
            limit=limit,
        )
    except batch.BatchError as exc:
        raise _batch_error(exc) from exc
    found = batch.with_status(found, _statuses(status))
    return {
        "sessions": [
            {
                "id": sid,
                "metadata": meta.metadata,
                "group": meta.group,
                "finish": _finish_json(finish),
                "first_weight_version": finish.first_weight_version,
                "policy_lag_exceeded": turn_service(request).policy.lag_exceeded(
                    finish.first_weight_version
                ),
            }
            for sid, meta, finish in found
        ]
    }


def _statuses(text: str | None) -> list[str] | None:
    if text is None:
        return None
    wanted = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in wanted if part not in FINISH_STATUSES]
    if unknown or not wanted:
        raise APIError(
            400,
            f"status takes a comma-separated list of {', '.join(FINISH_STATUSES)}",
            param="status",
        )
    return wanted


async def _group_state(request: Request, group_id: str) -> dict[str, Any]:
    check_session_id(group_id)
    found = await batch.groups(turn_service(request).store, [group_id])
    if group_id not in found:
        raise APIError(404, f"group {group_id!r} not found", param="group")
    group = found[group_id]
    return {
        **group.state(),
        "members": [
            {"id": meta.session_id, "finish": _finish_json(finish)}
            for meta, finish in group.members
        ],
    }


@router.post("/sessions/export", response_model=None)
async def export_batch(body: ExportBatch, request: Request) -> StreamingResponse:
    """Finished sessions as JSONL, one line per segment (`session_server.export.rows`).
    Every session is checked before the first line; a session deleted while the export
    streams ends it with an `{"error": ...}` line."""
    service = turn_service(request)
    store = service.store
    staleness = _staleness(body.min_weight_version, body.stale)
    try:
        if body.group is not None:
            found = await batch.groups(store, [body.group])
            if body.group not in found:
                raise APIError(404, f"group {body.group!r} not found", param="group")
            selected = found[body.group].finished
        elif body.session_ids is not None:
            for session_id in body.session_ids:
                check_session_id(session_id)
            selected = await batch.named(store, body.session_ids)
        else:
            selected = await batch.select(
                store,
                selector=batch.parse_selector(body.selector),
                since=body.since,
                until=body.until,
                limit=body.limit,
            )
        selected = await batch.whole_groups(
            store,
            selected,
            failed_members=body.failed_members,
            strict=body.group is not None or body.session_ids is not None,
        )
    except batch.BatchError as exc:
        raise _batch_error(exc) from exc
    selected = batch.with_status(selected, body.status)
    if not selected:
        raise APIError(404, "no finished session matches this export", param="selector")

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for row in batch.rows(store, selected, staleness, body.branches):
                row["policy_lag_exceeded"] = service.policy.lag_exceeded(
                    row["first_weight_version"]
                )
                yield json.dumps(row, separators=(",", ":")).encode() + b"\n"
        except SessionNotFound as exc:
            error = {"message": f"session {exc.args[0]!r} was deleted during the export"}
            yield json.dumps({"error": error}).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, request: Request, body: FinishSession | None = None
) -> dict[str, Any]:
    body = body or FinishSession()
    await _existing(request, session_id)
    finish = Finish(
        finished_at=time.time(),
        reward=body.reward,
        metadata=body.metadata or {},
        status=body.status,
    )
    try:
        cut = await turn_service(request).finish(session_id, finish)
    except AlreadyFinished as exc:
        raise APIError(409, f"session {session_id!r} is already finished") from exc
    return {"id": session_id, "finish": _finish_json(finish), "in_flight_cut": cut}


class AbortSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    finish: bool = False
    """Also finish the session (its finish metadata then says `"status": "aborted"`);
    default: the session stays usable."""


@router.post("/sessions/{session_id}/abort")
async def abort_session(
    session_id: str, request: Request, body: AbortSession | None = None
) -> dict[str, Any]:
    """Cut the session's generations in flight, on this server and (within ~0.25 s, the
    abort is recorded in the shared store) on every other server sharing its Redis: each
    stores its cut turn (finish_reason "abort") and its request is answered with an
    `aborted` error. A request that arrived before the abort but had not reached the engine
    (queued for a slot, being planned) gets the same error, no engine call, no turn stored.
    Answers once those on this server have (at most ~10 s); `aborted` counts them (a request
    still queued for a slot excepted)."""
    body = body or AbortSession()
    await _existing(request, session_id)
    service = turn_service(request)
    finish = None
    if body.finish:
        # Frozen first, atomically: an abort racing another finish changes nothing and
        # cuts nothing (409); the generations it then cuts are stored nowhere (see finish).
        finish = Finish(finished_at=time.time(), metadata={"status": "aborted"}, status="aborted")
        try:
            aborted = await service.finish(session_id, finish)
        except AlreadyFinished as exc:
            raise APIError(409, f"session {session_id!r} is already finished") from exc
    else:
        if await service.store.get_finish(session_id) is not None:
            raise APIError(409, f"session {session_id!r} is finished; nothing to abort")
        aborted = await service.abort(session_id)
    return {"id": session_id, "aborted": aborted, "finish": _finish_json(finish)}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    meta = await _existing(request, session_id)
    service = turn_service(request)
    turns = await service.store.all_turns(session_id)
    finish = await service.store.get_finish(session_id)
    first_version, lag_exceeded = service.policy.policy_lag(turns[0] if turns else None)
    return {
        "id": session_id,
        "created_at": meta.created_at,
        "ttl_seconds": meta.ttl_seconds,
        "sampling": meta.sampling_overrides,
        "metadata": meta.metadata,
        "routed_experts": meta.routed_experts,
        "group": meta.group,
        "group_size": meta.group_size,
        "finish": _finish_json(finish),
        **export.summary(session_id, turns),
        "engine_weight_versions": service.policy.engine_versions(),
        "first_weight_version": first_version,
        "policy_lag_exceeded": lag_exceeded,
        **_urls(request, session_id),
    }


@router.get("/sessions/{session_id}/trajectory", response_model=None)
async def get_trajectory(
    session_id: str,
    request: Request,
    format: Literal["json", "jsonl"] = "json",
    min_weight_version: float | None = None,
    stale: Literal["mask", "drop"] = "mask",
    branches: export.Branches = "all",
) -> dict[str, Any] | StreamingResponse:
    """`branches=all` (default): every root-to-leaf path of the turn tree; `last`: only the
    path to the most recently stored turn (one leaf per rollout)."""
    await _existing(request, session_id)
    staleness = _staleness(min_weight_version, stale)
    turns = await turn_service(request).store.all_turns(session_id)
    data = export.trajectory(session_id, turns, staleness, branches)
    if format == "json":
        return data

    async def lines() -> AsyncIterator[bytes]:
        for branch in data["branches"]:
            yield json.dumps({"session_id": session_id, **branch}).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/sessions/{session_id}/images/{sha256}", response_model=None)
async def get_image(session_id: str, sha256: str, request: Request) -> Response:
    """An image of the session, by the hash the trajectory lists it under (admin key, like
    the export): the trainer rebuilds pixel inputs from these bytes."""
    await _existing(request, session_id)
    data = await turn_service(request).store.get_image(session_id, sha256.lower())
    if data is None:
        raise APIError(404, f"session {session_id!r} has no image {sha256!r}", param="sha256")
    return Response(data, media_type=image_media_type(data))


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, request: Request) -> Response:
    check_session_id(session_id)
    if not await turn_service(request).sessions.delete(session_id):
        raise APIError(404, f"session {session_id!r} not found", param="session_id")
    return Response(status_code=204)
