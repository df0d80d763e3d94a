"""`POST /policy` (publish a checkpoint to every engine replica) and `GET /policy` (what is
published, and what each replica serves). Admin key only (api/auth.py): a session key gets
403. The work is `policy/fleet.py`'s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from session_server.api.errors import APIError, error_body
from session_server.policy.fleet import PolicyFleet, PublishError

router = APIRouter()

Version = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[!-~]+$")]


class PathSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    """A Hugging Face checkpoint folder (config.json + *.safetensors) that every engine and
    this server read at this path."""


class TransferSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    transfer: dict[str, Any]


class Publish(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Version | int = Field(union_mode="left_to_right")
    source: PathSource | TransferSource
    pause: Literal["keep", "wait", "abort"] = "keep"
    """What the replicas do with requests in flight: freeze them and resume them on the new
    weights (keep), let them finish on the old ones first (wait), or end them (abort)."""
    force: bool = False
    """Publish even when `version` is not newer than the published one."""


def _fleet(request: Request) -> PolicyFleet:
    fleet: PolicyFleet = request.app.state.policy
    return fleet


@router.post("/policy")
async def publish_policy(request: Request, body: Publish) -> Any:
    if isinstance(body.source, TransferSource):
        raise APIError(
            501,
            "transfer sources (vLLM's NCCL weight transfer) are not built yet: publish a "
            'checkpoint folder with {"source": {"path": DIR}}',
            param="source",
            type="not_supported",
        )
    try:
        return await _fleet(request).publish(
            str(body.version), body.source.path, body.pause, force=body.force
        )
    except PublishError as error:
        request.state.error = error.message
        content = error_body(request.url.path, error.status, error.message, type=error.kind)
        if error.replicas:
            content["replicas"] = error.replicas
        return JSONResponse(content, status_code=error.status)


@router.get("/policy")
async def get_policy(request: Request) -> dict[str, Any]:
    fleet = _fleet(request)
    await fleet.refresh()
    return fleet.status()
