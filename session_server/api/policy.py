"""`POST /policy` (publish a checkpoint to every engine replica) and `GET /policy` (what is
published, and what each replica serves). Admin key only (api/auth.py): a session key gets
403. The work is `policy/fleet.py`'s."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from session_server.api.errors import error_body
from session_server.api.health import store_memory
from session_server.policy.fleet import PolicyFleet, PublishError
from session_server.policy.transfer import FleetTransfer

router = APIRouter()

Version = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[!-~]+$")]


class PathSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    """A Hugging Face checkpoint folder (config.json + *.safetensors) that every engine and
    this server read at this path."""


class TransferStart(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TransferSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    transfer: TransferStart
    """`{}`: the trainer sends the weights itself (vLLM's weight transfer), through the group
    `POST /policy/transfer/init` formed. This call pauses every replica and readies it to
    receive; the trainer then broadcasts while it calls `/policy/transfer/update`, and ends
    with `/policy/transfer/finish` (tokenkeep's client drives it: `publish_policy(version,
    transfer=engine)`)."""


class TransferInit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    init_info: dict[str, Any]
    """vLLM's worker init info as its trainer engine builds it (`master_address`,
    `master_port` or `nccl_unique_id_b64`, `world_size`, `packed`, ...); `rank_offset` is
    set per replica by tokenkeep."""


class TransferUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    update_info: dict[str, Any] | list[dict[str, Any]]
    """vLLM's update info (`names`, `dtype_names`, `shapes`), passed to every replica."""


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


def _transfers(request: Request) -> FleetTransfer:
    transfers: FleetTransfer = request.app.state.transfers
    return transfers


async def _answer(request: Request, work: Awaitable[dict[str, Any]]) -> Any:
    try:
        return await work
    except PublishError as error:
        request.state.error = error.message
        content = error_body(request.url.path, error.status, error.message, type=error.kind)
        if error.replicas:
            content["replicas"] = error.replicas
        return JSONResponse(content, status_code=error.status)


@router.post("/policy")
async def publish_policy(request: Request, body: Publish) -> Any:
    version = str(body.version)
    if isinstance(body.source, TransferSource):
        start = _transfers(request).start_transfer(version, body.pause, force=body.force)
        return await _answer(request, start)
    return await _answer(
        request, _fleet(request).publish(version, body.source.path, body.pause, force=body.force)
    )


@router.get("/policy/transfer")
async def transfer_group(request: Request) -> Any:
    """The world size a new transfer group needs, and the group as it stands."""
    return await _answer(request, _transfers(request).transfer_world_size())


@router.post("/policy/transfer/init")
async def init_transfer(request: Request, body: TransferInit) -> Any:
    return await _answer(request, _transfers(request).init_transfer(body.init_info))


@router.post("/policy/transfer/update")
async def update_transfer(request: Request, body: TransferUpdate) -> Any:
    return await _answer(request, _transfers(request).update_transfer(body.update_info))


@router.post("/policy/transfer/finish")
async def finish_transfer(request: Request) -> Any:
    return await _answer(request, _transfers(request).finish_transfer())


@router.get("/policy")
async def get_policy(request: Request) -> dict[str, Any]:
    fleet = _fleet(request)
    await fleet.refresh()
    # The operator reads this answer for its SessionServer status: the store's memory (its
    # StoreFull condition) rides along, so that one poll says both.
    store = await store_memory(request)
    return {"transfer": _transfers(request).status(), **fleet.status(), "store": store}
