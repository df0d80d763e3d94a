"""Session management, finished rollouts and trajectory export (single and batch): each
handler parses its request and calls `management.SessionService`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from session_server import batch, export
from session_server.api import session_service
from session_server.api.errors import APIError
from session_server.api.params import TemplateKwargs
from session_server.api.session_ids import SESSION_ID_PATTERN, check_session_id
from session_server.conversation import MAX_JSON_DEPTH, too_deep
from session_server.images import image_media_type
from session_server.management import finish_json, session_json, staleness
from session_server.sampling import SamplingParams
from session_server.store.base import FINISH_STATUSES, FinishStatus

router = APIRouter()

MAX_TTL_SECONDS = 100 * 365 * 86_400
"""A century: past any rollout, and far inside what Redis' PEXPIRE takes (milliseconds
that, added to the clock, fit in 64 bits), so both stores keep what is accepted."""


def _bounded_depth(value: dict[str, Any]) -> dict[str, Any]:
    if too_deep(value):
        raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_bounded_depth)]
"""Session metadata: stored, then serialised into every listing and export row (which fail
on nesting Python's JSON parser took), so refused before it is stored."""


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN.pattern)
    sampling: SamplingParams | None = None
    """Sampling overrides that win over whatever the harness sends (vLLM names), checked as
    each request's sampling is: one that every turn would fail on is refused here."""
    metadata: Metadata | None = None
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_SECONDS)
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
    reasoning_ended: bool | None = None
    """Every turn is sent to vLLM with `reasoning_ended` unless its request says otherwise:
    `tool_choice` ("required" or a named tool) and structured outputs constrain the reply from
    its first token instead of after a reasoning block the model must close itself. How a
    random-weights or untrained model is made to call a tool (the demo's harness loop)."""
    chat_template_kwargs: TemplateKwargs | None = None
    """Variables every turn's chat template renders with, as vLLM's `chat_template_kwargs`
    (`{"enable_thinking": false}`); a request's own `chat_template_kwargs` win key by key."""
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
    meta, api_key = await session_service(request).create(
        body.id,
        ttl_seconds=body.ttl_seconds,
        sampling=None if body.sampling is None else body.sampling.model_dump(exclude_none=True),
        metadata=body.metadata,
        normalization=body.normalization,
        return_token_ids=body.return_token_ids,
        routed_experts=body.routed_experts,
        reasoning_ended=body.reasoning_ended,
        chat_template_kwargs=body.chat_template_kwargs,
        group=body.group,
        group_size=body.group_size,
    )
    return {
        **session_json(meta),
        **_urls(request, meta.session_id),
        # The only time the key is shown: the store keeps its digest only.
        "api_key": api_key,
    }


class FinishSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = Field(default=None, allow_inf_nan=False, strict=True)
    """A finite JSON number: `true` or `"1.0"` is refused, not read as 1.0."""
    metadata: Metadata | None = None
    status: FinishStatus = "ok"
    """`ok`, or why the rollout failed (a group holds or drops its failed members)."""


class ExportBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_ids: list[str] | None = Field(default=None, min_length=1)
    """Export exactly these (each must be finished); otherwise select by the fields below."""
    selector: str | None = None
    """`key=value,...` over the session metadata given at creation."""
    since: float | None = Field(default=None, allow_inf_nan=False)
    """Finished at or after this Unix time."""
    until: float | None = Field(default=None, allow_inf_nan=False)
    limit: int = Field(default=1000, ge=1, le=100_000)
    min_weight_version: float | None = Field(default=None, allow_inf_nan=False)
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
    since: float | None = Query(default=None, allow_inf_nan=False),
    until: float | None = Query(default=None, allow_inf_nan=False),
    limit: int = 1000,
    status: str | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    """Finished sessions (the only ones listed: a listing of running ones would need an
    index written on every turn), each with `first_weight_version` and
    `policy_lag_exceeded`, or with `group`, that group's state and every member."""
    service = session_service(request)
    if group is not None:
        return await service.group_state(check_session_id(group))
    if not finished:
        raise APIError(
            400, "only finished sessions can be listed (finished=true)", param="finished"
        )
    sessions = await service.finished(
        selector=selector, since=since, until=until, limit=limit, statuses=_statuses(status)
    )
    return {"sessions": sessions}


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


@router.post("/sessions/export", response_model=None)
async def export_batch(body: ExportBatch, request: Request) -> StreamingResponse:
    """Finished sessions as JSONL, one line per segment (`session_server.export.rows`).
    Every session is checked before the first line; a session deleted while the export
    streams ends it with an `{"error": ...}` line."""
    service = session_service(request)
    stale_filter = staleness(body.min_weight_version, body.stale)
    for session_id in body.session_ids or ():
        check_session_id(session_id)
    selected = await service.export_selection(
        group=body.group,
        session_ids=body.session_ids,
        selector=body.selector,
        since=body.since,
        until=body.until,
        limit=body.limit,
        failed_members=body.failed_members,
        statuses=body.status,
    )
    return StreamingResponse(
        service.export_lines(selected, stale_filter, body.branches),
        media_type="application/x-ndjson",
    )


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, request: Request, body: FinishSession | None = None
) -> dict[str, Any]:
    body = body or FinishSession()
    finish, cut = await session_service(request).finish(
        check_session_id(session_id),
        reward=body.reward,
        metadata=body.metadata,
        status=body.status,
    )
    return {"id": session_id, "finish": finish_json(finish), "in_flight_cut": cut}


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
    aborted, finish = await session_service(request).abort(
        check_session_id(session_id), finish=body.finish
    )
    return {"id": session_id, "aborted": aborted, "finish": finish_json(finish)}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    described = await session_service(request).describe(check_session_id(session_id))
    return {**described, **_urls(request, session_id)}


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
    stale_filter = staleness(min_weight_version, stale)
    data = await session_service(request).trajectory(
        check_session_id(session_id), stale_filter, branches
    )
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
    data = await session_service(request).image(check_session_id(session_id), sha256)
    return Response(data, media_type=image_media_type(data))


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, request: Request) -> Response:
    await session_service(request).delete(check_session_id(session_id))
    return Response(status_code=204)
