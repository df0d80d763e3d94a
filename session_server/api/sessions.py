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
from session_server.api.auth import issue_session_key
from session_server.api.errors import APIError
from session_server.api.session_ids import SESSION_ID_PATTERN, check_session_id
from session_server.images import image_media_type
from session_server.store.base import AlreadyFinished, Finish, SessionNotFound

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


def _urls(request: Request, session_id: str) -> dict[str, str]:
    base = str(request.base_url).rstrip("/")
    return {
        "openai_base_url": f"{base}/sessions/{session_id}/v1",
        "anthropic_base_url": f"{base}/sessions/{session_id}",
    }


@router.post("/sessions", status_code=201)
async def create_session(request: Request, body: CreateSession | None = None) -> dict[str, Any]:
    body = body or CreateSession()
    service = request.app.state.turns
    session_id = body.id or uuid.uuid4().hex
    if body.id and await service.store.get_session(session_id) is not None:
        raise APIError(409, f"session {session_id!r} already exists", param="id")
    api_key, key_hash = issue_session_key(session_id)
    meta = await service.create_session(
        session_id,
        ttl_seconds=body.ttl_seconds if body.ttl_seconds is not None else -1,
        sampling_overrides=body.sampling,
        metadata=body.metadata,
        normalization=body.normalization,
        return_token_ids=body.return_token_ids,
        key_hash=key_hash,
        routed_experts=body.routed_experts,
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
        **_urls(request, meta.session_id),
        # The only time the key is shown: the store keeps its digest only.
        "api_key": api_key,
    }


async def _existing(request: Request, session_id: str) -> Any:
    check_session_id(session_id)
    meta = await request.app.state.turns.store.get_session(session_id)
    if meta is None:
        raise APIError(404, f"session {session_id!r} not found", param="session_id")
    return meta


def _finish_json(finish: Finish | None) -> dict[str, Any] | None:
    if finish is None:
        return None
    return {"finished_at": finish.finished_at, "reward": finish.reward, "metadata": finish.metadata}


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
    reward: float | None = Field(default=None, allow_inf_nan=False)
    metadata: dict[str, Any] | None = None


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


@router.get("/sessions")
async def list_sessions(
    request: Request,
    finished: bool = True,
    selector: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int = 1000,
) -> dict[str, Any]:
    """Finished sessions (the only ones listed: a listing of running ones would need an
    index written on every turn)."""
    if not finished:
        raise APIError(
            400, "only finished sessions can be listed (finished=true)", param="finished"
        )
    if not 1 <= limit <= 100_000:
        raise APIError(400, "limit must be between 1 and 100000", param="limit")
    try:
        found = await batch.select(
            request.app.state.turns.store,
            selector=batch.parse_selector(selector),
            since=since,
            until=until,
            limit=limit,
        )
    except batch.BatchError as exc:
        raise _batch_error(exc) from exc
    return {
        "sessions": [
            {"id": sid, "metadata": meta.metadata, "finish": _finish_json(finish)}
            for sid, meta, finish in found
        ]
    }


@router.post("/sessions/export", response_model=None)
async def export_batch(body: ExportBatch, request: Request) -> StreamingResponse:
    """Finished sessions as JSONL, one line per segment (`session_server.export.rows`).
    Every session is checked before the first line; a session deleted while the export
    streams ends it with an `{"error": ...}` line."""
    store = request.app.state.turns.store
    staleness = _staleness(body.min_weight_version, body.stale)
    try:
        if body.session_ids is not None:
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
    except batch.BatchError as exc:
        raise _batch_error(exc) from exc
    if not selected:
        raise APIError(404, "no finished session matches this export", param="selector")

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for row in batch.rows(store, selected, staleness):
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
    finish = Finish(finished_at=time.time(), reward=body.reward, metadata=body.metadata or {})
    try:
        await request.app.state.turns.store.finish_session(session_id, finish)
    except AlreadyFinished as exc:
        raise APIError(409, f"session {session_id!r} is already finished") from exc
    return {"id": session_id, "finish": _finish_json(finish)}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    meta = await _existing(request, session_id)
    service = request.app.state.turns
    turns = await service.store.all_turns(session_id)
    finish = await service.store.get_finish(session_id)
    return {
        "id": session_id,
        "created_at": meta.created_at,
        "ttl_seconds": meta.ttl_seconds,
        "sampling": meta.sampling_overrides,
        "metadata": meta.metadata,
        "routed_experts": meta.routed_experts,
        "finish": _finish_json(finish),
        **export.summary(session_id, turns),
        "engine_weight_versions": service.engine_versions(),
        **_urls(request, session_id),
    }


@router.get("/sessions/{session_id}/trajectory", response_model=None)
async def get_trajectory(
    session_id: str,
    request: Request,
    format: Literal["json", "jsonl"] = "json",
    min_weight_version: float | None = None,
    stale: Literal["mask", "drop"] = "mask",
) -> dict[str, Any] | StreamingResponse:
    await _existing(request, session_id)
    staleness = _staleness(min_weight_version, stale)
    turns = await request.app.state.turns.store.all_turns(session_id)
    data = export.trajectory(session_id, turns, staleness)
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
    data = await request.app.state.turns.store.get_image(session_id, sha256.lower())
    if data is None:
        raise APIError(404, f"session {session_id!r} has no image {sha256!r}", param="sha256")
    return Response(data, media_type=image_media_type(data))


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, request: Request) -> Response:
    check_session_id(session_id)
    if not await request.app.state.turns.delete_session(session_id):
        raise APIError(404, f"session {session_id!r} not found", param="session_id")
    return Response(status_code=204)
