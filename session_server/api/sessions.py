"""Session management and trajectory export."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from session_server import export
from session_server.api.auth import issue_session_key
from session_server.api.errors import APIError
from session_server.api.session_ids import SESSION_ID_PATTERN, check_session_id

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
    )
    if meta.key_hash != key_hash:  # created concurrently by another request: not ours
        raise APIError(409, f"session {session_id!r} already exists", param="id")
    return {
        "id": meta.session_id,
        "created_at": meta.created_at,
        "ttl_seconds": meta.ttl_seconds,
        "sampling": meta.sampling_overrides,
        "metadata": meta.metadata,
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


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    meta = await _existing(request, session_id)
    turns = await request.app.state.turns.store.all_turns(session_id)
    return {
        "id": session_id,
        "created_at": meta.created_at,
        "ttl_seconds": meta.ttl_seconds,
        "sampling": meta.sampling_overrides,
        "metadata": meta.metadata,
        **export.summary(session_id, turns),
        **_urls(request, session_id),
    }


@router.get("/sessions/{session_id}/trajectory", response_model=None)
async def get_trajectory(
    session_id: str, request: Request, format: Literal["json", "jsonl"] = "json"
) -> dict[str, Any] | StreamingResponse:
    await _existing(request, session_id)
    turns = await request.app.state.turns.store.all_turns(session_id)
    data = export.trajectory(session_id, turns)
    if format == "json":
        return data

    async def lines() -> AsyncIterator[bytes]:
        for branch in data["branches"]:
            yield json.dumps({"session_id": session_id, **branch}).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, request: Request) -> Response:
    check_session_id(session_id)
    if not await request.app.state.turns.delete_session(session_id):
        raise APIError(404, f"session {session_id!r} not found", param="session_id")
    return Response(status_code=204)
