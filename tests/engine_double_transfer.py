"""A TEST DOUBLE of vLLM 0.32's RL endpoints with its NCCL weight transfer, on top of the vLLM
double (`tests/engine_double.py`), and the trainer's end of the transfer group.

Why a double: every weight-transfer backend vLLM 0.32 registers needs CUDA (`nccl`,
`sparse_nccl`, `nccl_m2n`: NCCL through `PyNcclCommunicator`; `ipc`: CUDA IPC handles;
`sharded_rdt`: CUDA events and Ray; `modelexpress`: a separate package), and this machine has
no GPU, so the real CPU engine cannot take a transfer. The routes take the bodies and give the
answers of `vllm/entrypoints/rl/online/api_router.py` (`/pause?mode=`, `/resume`,
`/reset_prefix_cache`, `/weight_checker`, `/get_world_size`, `/init_weight_transfer_engine
{"init_info"}`, `/start_weight_update`, `/update_weights {"update_info"}`,
`/finish_weight_update {"weight_version"}`, `/shutdown_weight_transfer_engine`), refuse what
vLLM's worker refuses (`vllm/v1/worker/gpu_worker.py`: a second start while an update is
active, an update or finish without a start, an update with no group), and block where NCCL
blocks: `/init_weight_transfer_engine` until every rank of the group has joined (vLLM's
TCPStore rendezvous), `/update_weights` until the trainer's broadcast has reached every rank.
`NcclGroup` is that group: rank 0 is the test's trainer; a rank that never joins makes the
others wait until the group's timeout, as a real collective hangs.

The weights are a label (`weights`), checksummed by `/weight_checker`; a broadcast carries the
trainer's label, and vLLM's finish without an update puts the old weights back (its layerwise
reload restores the kernel tensors it kept).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.engine_double import EngineDouble


class NcclGroup:
    """The trainer-and-workers group of one `init_info` (keyed by master address and port).
    `join` is the rendezvous (every rank 0..world_size-1 exactly once), `broadcast` (rank 0)
    and `receive` (the others) one round of the collective."""

    groups: ClassVar[dict[tuple[str, int], NcclGroup]] = {}

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float = 5.0):
        self.address, self.port, self.world_size = address, port, world_size
        self.timeout_s = timeout_s
        self.ranks: set[int] = set()
        self.payload: dict[str, Any] | None = None
        self.round = 0
        self.received: set[int] = set()
        self._cond = threading.Condition()
        NcclGroup.groups[(address, port)] = self

    def close(self) -> None:
        NcclGroup.groups.pop((self.address, self.port), None)

    def join(self, ranks: list[int]) -> None:
        with self._cond:
            taken = self.ranks & set(ranks)
            outside = [r for r in ranks if not 0 <= r < self.world_size]
            if taken or outside:
                raise RuntimeError(f"ranks {sorted(taken) + outside} taken or outside the group")
            self.ranks |= set(ranks)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(self.ranks) == self.world_size, self.timeout_s):
                missing = sorted(set(range(self.world_size)) - self.ranks)
                raise TimeoutError(f"rendezvous timed out waiting for ranks {missing}")

    def broadcast(self, payload: dict[str, Any]) -> None:
        """Rank 0 sends; returns once every other rank has received (a hang otherwise)."""
        with self._cond:
            self.payload, self.received = payload, set()
            self.round += 1
            self._cond.notify_all()
            receivers = set(range(1, self.world_size))
            if not self._cond.wait_for(lambda: self.received == receivers, self.timeout_s):
                raise TimeoutError(f"broadcast: ranks {sorted(receivers - self.received)} absent")

    def receive(self, ranks: list[int], after_round: int) -> tuple[int, dict[str, Any]]:
        with self._cond:
            if not self._cond.wait_for(lambda: self.round > after_round, self.timeout_s):
                raise TimeoutError("no broadcast came")
            self.received |= set(ranks)
            self._cond.notify_all()
            assert self.payload is not None
            return self.round, self.payload


@dataclass
class TransferEngineDouble(EngineDouble):
    """See the module docstring. `control` records each control call (path, body or query)
    in order; `fail` maps a path to the status it answers once (then it is removed)."""

    dev_mode: bool = True
    world_size: int = 1
    """Its workers (TP x PP x DP): the ranks it takes in a transfer group."""
    weights: str = "base"
    paused: str | None = None
    group: NcclGroup | None = None
    rank_offset: int | None = None
    update_active: bool = False
    staged: str | None = None
    received_round: int = 0
    control: list[tuple[str, Any]] = field(default_factory=list)
    fail: dict[str, int] = field(default_factory=dict)

    def restart(self) -> None:
        """The engine process started again: base weights, no group, nothing paused."""
        self.weights, self.weight_version, self.paused = "base", "default", None
        self.group = self.rank_offset = self.staged = None
        self.update_active, self.received_round = False, 0

    def checksum_of(self, weights: str) -> dict[str, str]:
        return {"model.weight": hashlib.sha256(weights.encode()).hexdigest()}

    def paths(self) -> list[str]:
        return [path for path, _ in self.control]

    def _app(self) -> Starlette:
        app = super()._app()
        for path, handler, method in (
            ("/pause", self._pause, "POST"),
            ("/resume", self._resume, "POST"),
            ("/reset_prefix_cache", self._reset_prefix_cache, "POST"),
            ("/weight_checker", self._weight_checker, "POST"),
            ("/get_world_size", self._get_world_size, "GET"),
            ("/init_weight_transfer_engine", self._init, "POST"),
            ("/shutdown_weight_transfer_engine", self._shutdown, "POST"),
            ("/start_weight_update", self._start, "POST"),
            ("/update_weights", self._update, "POST"),
            ("/finish_weight_update", self._finish, "POST"),
        ):
            app.router.routes.append(Route(path, handler, methods=[method]))
        return app

    async def _record(self, request: Request) -> tuple[Any, Response | None]:
        body = await request.body()
        shown = dict(request.query_params) if not body else await request.json()
        self.control.append((request.url.path, shown))
        status = self.fail.pop(request.url.path, None)
        if status is not None:
            return shown, JSONResponse({"error": "injected failure"}, status_code=status)
        return shown, None

    async def _pause(self, request: Request) -> Response:
        query, failed = await self._record(request)
        if failed:
            return failed
        self.paused = query.get("mode", "abort")
        return JSONResponse({"status": "paused"})

    async def _resume(self, request: Request) -> Response:
        _, failed = await self._record(request)
        if failed:
            return failed
        self.paused = None
        return JSONResponse({"status": "resumed"})

    async def _reset_prefix_cache(self, request: Request) -> Response:
        _, failed = await self._record(request)
        return failed or JSONResponse({"success": True})

    async def _weight_checker(self, request: Request) -> Response:
        _, failed = await self._record(request)
        return failed or JSONResponse({"checksums": self.checksum_of(self.weights)})

    async def _get_world_size(self, request: Request) -> Response:
        _, failed = await self._record(request)
        return failed or JSONResponse({"world_size": self.world_size})

    async def _init(self, request: Request) -> Response:
        body, failed = await self._record(request)
        if failed:
            return failed
        info = body["init_info"]
        group = NcclGroup.groups.get((info["master_address"], info["master_port"]))
        if group is None or info["world_size"] != group.world_size:
            return _internal("StatelessProcessGroup: no such rendezvous")
        ranks = list(range(info["rank_offset"], info["rank_offset"] + self.world_size))
        try:
            await asyncio.to_thread(group.join, ranks)
        except (RuntimeError, TimeoutError) as error:
            return _internal(str(error))
        self.group, self.rank_offset, self.received_round = group, info["rank_offset"], 0
        return JSONResponse({"message": "Weight transfer initialized"})

    async def _shutdown(self, request: Request) -> Response:
        _, failed = await self._record(request)
        self.group = None
        return failed or JSONResponse({"message": "Weight transfer shut down"})

    async def _start(self, request: Request) -> Response:
        _, failed = await self._record(request)
        if failed:
            return failed
        if self.update_active:
            return _internal("start_weight_update called while a weight update is active")
        self.update_active, self.staged = True, None
        return JSONResponse({"message": "Weight update started"})

    async def _update(self, request: Request) -> Response:
        body, failed = await self._record(request)
        if failed:
            self.update_active = False
            return failed
        if not self.update_active:
            return _internal("start_weight_update must be called before update_weights.")
        if self.group is None or self.rank_offset is None:
            return _internal("NCCL weight transfer not initialized.")
        ranks = list(range(self.rank_offset, self.rank_offset + self.world_size))
        try:
            self.received_round, payload = await asyncio.to_thread(
                self.group.receive, ranks, self.received_round
            )
        except TimeoutError as error:
            self.update_active = False
            return _internal(str(error))
        if body["update_info"]["names"] != payload["names"]:
            self.update_active = False
            return _internal("update_info disagrees with the broadcast")
        self.staged = payload["weights"]
        return JSONResponse({"message": "Weights updated"})

    async def _finish(self, request: Request) -> Response:
        body, failed = await self._record(request)
        if failed:
            return failed
        if not self.update_active:
            return _internal("finish_weight_update called without a matching start")
        if self.staged is not None:
            self.weights = self.staged
        self.update_active, self.staged = False, None
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None:
            self.weight_version = str(version)
        return JSONResponse({"message": "Weight update finished"})


def _internal(message: str) -> Response:
    """A worker's error as vLLM 0.32's API server answers it (recorded from the CPU engine:
    tests/integration/test_policy_vllm.py checks the update-before-start one)."""
    error = (
        f"Call to collective_rpc method failed: Worker failed with error '{message}', please "
        "check the stack trace above for the root cause"
    )
    body = {"message": error, "type": "InternalServerError", "param": None, "code": 500}
    return JSONResponse({"error": body}, status_code=500)


class DoubleTrainerEngine:
    """The trainer's side, as vLLM 0.32's `NCCLTrainerWeightTransferEngine` does it
    (`vllm/distributed/weight_transfer/nccl_engine.py`; vLLM is not importable in this
    virtualenv): `trainer_init` calls `client.init_weight_transfer_engine` on a side thread
    while it opens rank 0, `send_weights` calls `start_weight_update`, then `update_weights`
    on a side thread while it broadcasts, then `finish_weight_update`. The broadcast is
    `NcclGroup`'s; the weights are the label `weights`."""

    def __init__(self, client: Any, group: NcclGroup, names: list[str]) -> None:
        self.client, self.group, self.names = client, group, names
        self.weights = "base"
        self.broadcasts = 0
        self.update_error: BaseException | None = None

    @staticmethod
    def init_info(group: NcclGroup) -> dict[str, Any]:
        """What the trainer sends to init the engines' ends of the group."""
        return {
            "master_address": group.address,
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": group.world_size,
            "packed": True,
        }

    def update_info(self) -> dict[str, Any]:
        """What the trainer sends with each update: the tensors it is about to broadcast."""
        return {"names": self.names, "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}

    @classmethod
    def trainer_init(cls, client: Any, group: NcclGroup) -> DoubleTrainerEngine:
        engine = cls(client, group, ["model.weight"])
        init_info = cls.init_info(group)
        errors: list[BaseException] = []

        def init() -> None:
            try:
                client.init_weight_transfer_engine(init_info)
            except BaseException as error:  # surfaced below, as future.result() does
                errors.append(error)

        thread = threading.Thread(target=init)
        thread.start()
        group.join([0])
        thread.join()
        if errors:
            raise errors[0]
        return engine

    def send_weights(self) -> None:
        update_info = self.update_info()
        self.client.start_weight_update()
        self.update_error = None

        def update() -> None:
            try:
                self.client.update_weights(update_info)
            except BaseException as error:  # kept for the test; raised as vLLM raises it
                self.update_error = error

        thread = threading.Thread(target=update)
        thread.start()
        try:
            self.group.broadcast({"names": self.names, "weights": self.weights})
            self.broadcasts += 1
        finally:
            thread.join()
        if self.update_error is not None:
            raise self.update_error
        self.client.finish_weight_update()
