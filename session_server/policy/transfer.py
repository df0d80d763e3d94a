"""Publishing a policy the trainer sends itself: vLLM 0.32's weight transfer (its NCCL
backend), `{"source": {"transfer": {}}}` and `/policy/transfer/*`.

The trainer drives vLLM's own trainer-side engine (`NCCLTrainerWeightTransferEngine`) through
tokenkeep's client, which implements vLLM's `VLLMWeightSyncClient`: each of its calls is one
of these, fanned out to every replica in parallel.
1. `init`: every replica joins the trainer's group at its own ranks (once per group);
2. `start` (`POST /policy`): every member paused and ready to receive: the trainer's
   go-ahead to broadcast;
3. `update`: runs concurrently with the trainer's broadcast (both meet in the same NCCL
   calls);
4. `finish`: the version, then as a folder publish ends (`PolicyFleet.conclude`).

The fleet's own rules hold: one driver at a time (the policy lease, `PolicyFleet.take_fleet`,
held from the start to the finish), a failed replica fenced and never rolled back once it
received weights, the published policy stored for every server to follow. A replica behind a
transferred policy cannot be caught up by tokenkeep (`PolicyFleet` fences it
`awaiting_transfer`).

SGLang 0.5.23 engines take the same four phases through their update from distributed
(`policy/control.py::SglangControl`: init is `/init_weights_update_group`, start only the
pause, update `/update_weights_from_distributed` with the trainer's tensor names, dtypes and
shapes, finish the version); the trainer's side is its own torch.distributed broadcast
(docs/trainer.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from session_server.engine_wire.base import Replica
from session_server.policy.control import (
    ControlError,
    SglangControl,
    VllmControl,
    control_class,
)
from session_server.policy.fleet import (
    AWAITING_TRANSFER,
    RESEND,
    PolicyFleet,
    PublishError,
    ReplicaOutcome,
    stop_task,
)
from session_server.policy.state import PublishedPolicy

logger = logging.getLogger(__name__)

# A transfer publish spans the trainer's calls (start, update, finish); one left this long
# without its next call is ended by tokenkeep (the trainer died or gave up).
TRANSFER_IDLE_S = 60.0


@dataclass(slots=True)
class TransferGroup:
    """The trainer's weight-transfer group (vLLM's NCCL backend): the first rank of each
    replica that joined it. A member marked down since (maybe restarted: its communicator is
    gone) breaks the group: a broadcast would wait for it forever, so no transfer starts
    until the trainer initialises a new group."""

    world_size: int
    ranks: dict[str, int]
    broken: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "ranks": self.ranks, "broken": self.broken}


@dataclass(slots=True)
class Transfer:
    """A transfer publish between the trainer's calls: started (every member paused and
    ready to receive), then updated (the weights received: one or more chunks, as vLLM's
    worker takes them), then finished."""

    target: PublishedPolicy
    previous: PublishedPolicy | None
    moved: list[tuple[Replica, ReplicaOutcome]]
    started: float
    renew: asyncio.Task[None] = field(repr=False)
    updated: bool = False
    updating: bool = False
    idle: asyncio.Task[None] | None = field(default=None, repr=False)


class FleetTransfer:
    """The transfer group and the transfer publish in flight, on this server."""

    def __init__(self, fleet: PolicyFleet) -> None:
        self.fleet = fleet
        self.group: TransferGroup | None = None
        self.transfer: Transfer | None = None
        fleet.engine.on_replica_unverified.append(self._unverified)

    def _unverified(self, replica: Replica) -> None:
        group = self.group
        if group is not None and replica.url in group.ranks and group.broken is None:
            group.broken = f"{replica.url} left the group (marked down or new since it joined)"

    async def close(self) -> None:
        """Stop the transfer's tasks: its lease lapses; its engines stay paused."""
        if self.transfer is not None:
            for task in (self.transfer.renew, self.transfer.idle):
                if task is not None:
                    await stop_task(task)

    def status(self) -> dict[str, Any] | None:
        return None if self.group is None else self.group.as_json()

    def _transfer_control(self, replica: Replica) -> VllmControl | SglangControl:
        control = self.fleet.control(replica)
        # check_engine(transfer=True) refused the others
        assert isinstance(control, VllmControl | SglangControl)
        return control

    def _check_info(self, **info: Any) -> None:
        refusal = control_class(self.fleet.engine.wire.kind).refusal(**info)
        if refusal is not None:
            raise PublishError(400, refusal, "bad_transfer")

    async def transfer_world_size(self) -> dict[str, Any]:
        """The world size a new transfer group needs (the trainer's rank 0 plus every
        replica's workers; null with the reasons where a replica cannot say), and the group
        as it stands."""
        kind = self.fleet.engine.wire.kind
        if not control_class(kind).transfers:
            reason = f"{kind} engines take no weight transfer from tokenkeep"
            return {"world_size": None, "reason": reason, "replicas": [], "group": self.status()}
        replicas = self.fleet.engine.replicas
        sizes = await self._world_sizes(replicas)
        known = [size for size in sizes if isinstance(size, int)]
        return {
            "world_size": 1 + sum(known) if len(known) == len(sizes) else None,
            "replicas": [
                {"engine": r.url, "world_size": size}
                if isinstance(size, int)
                else {"engine": r.url, "world_size": None, "reason": str(size)}
                for r, size in zip(replicas, sizes, strict=True)
            ],
            "group": self.status(),
        }

    async def _world_sizes(self, replicas: list[Replica]) -> list[int | ControlError]:
        """Each replica's ranks (`/get_world_size`), or why it cannot say."""
        sizes = await asyncio.gather(
            *(self._transfer_control(r).world_size() for r in replicas), return_exceptions=True
        )
        found: list[int | ControlError] = []
        for size in sizes:
            if isinstance(size, BaseException) and not isinstance(size, ControlError):
                raise size
            found.append(size)
        return found

    async def init_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Every replica joins the trainer's group (vLLM's `/init_weight_transfer_engine`) at
        its own ranks: the trainer is rank 0, replica i's workers follow replica i-1's. The
        trainer sends the worker init info vLLM's trainer engine builds (its `rank_offset` is
        replaced here); this answers once all ranks have met, so the trainer opens its end
        concurrently, as vLLM's `trainer_init` does."""
        self.fleet.check_engine("keep", transfer=True)
        self._check_info(init_info=init_info)
        if self.transfer is not None:
            raise _transfer_running(self.transfer)
        replicas = self.fleet.engine.replicas
        renew = await self.fleet.take_fleet()
        try:
            found = await self._world_sizes(replicas)
            errors = [str(size) for size in found if isinstance(size, ControlError)]
            if errors:
                raise PublishError(502, "; ".join(errors), "transfer_failed")
            sizes = [size for size in found if isinstance(size, int)]
            needed = 1 + sum(sizes)
            if init_info.get("world_size") != needed:
                raise PublishError(
                    400,
                    f"init_info.world_size is {init_info.get('world_size')!r}; this fleet needs "
                    f"{needed} (the trainer's rank 0 and {needed - 1} engine workers in "
                    f"{len(replicas)} replicas)",
                    "bad_transfer",
                )
            ranks, offset = {}, 1
            for replica, size in zip(replicas, sizes, strict=True):
                ranks[replica.url] = offset
                offset += size
            previous, self.group = self.group, None
            if previous is not None:  # release the old communicators; a new group follows
                await asyncio.gather(
                    *(
                        self._transfer_control(r).shutdown_transfer()
                        for r in replicas
                        if r.url in previous.ranks
                    ),
                    return_exceptions=True,
                )
            results = await asyncio.gather(
                *(
                    self._transfer_control(r).init_transfer(
                        {**init_info, "rank_offset": ranks[r.url]}
                    )
                    for r in replicas
                ),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, ControlError):
                    raise result
            failed = [f"{e.engine}: {e.step}: {e.reason}" for e in results if e is not None]
            if failed:
                raise PublishError(
                    502,
                    "the transfer group was not formed: " + "; ".join(failed),
                    "transfer_failed",
                )
            self.group = TransferGroup(needed, ranks)
            return {"world_size": needed, "ranks": ranks}
        finally:
            await self.fleet.release_fleet(renew)

    async def start_transfer(self, version: str, pause: str, *, force: bool) -> dict[str, Any]:
        """Pause every member in `pause` mode and start its update: the trainer's go-ahead
        to broadcast. A member that fails means no broadcast: the others put their weights
        back (finish without an update) and resume; the failed one is fenced."""
        self.fleet.check_engine(pause, transfer=True)
        if self.transfer is not None:
            raise _transfer_running(self.transfer)
        group = self.group
        if group is None:
            raise PublishError(
                409,
                "no transfer group: the trainer initialises one first "
                "(POST /policy/transfer/init, vLLM's trainer_init)",
                "no_transfer_group",
            )
        renew = await self.fleet.take_fleet()
        kept = False
        try:
            current = await self.fleet.current_for(version, force)
            members = self._members(group)
            if current is not None:
                pending = dataclasses.replace(current, pending=version)
                await self.fleet.store.put_policy(pending.encode())
            source = {"transfer": {"world_size": group.world_size}}
            target = PublishedPolicy(version, source, time.time(), pause, None)
            moved = [(r, ReplicaOutcome(r.url, inflight=r.inflight)) for r in members]
            for replica in members:
                self.fleet.state_of(replica.url).state = "updating"
            started = time.perf_counter()
            await asyncio.gather(
                *(self._start_one(replica, pause, outcome) for replica, outcome in moved)
            )
            failed = [(r, o) for r, o in moved if o.reason is not None]
            if failed:
                await self._put_back([(r, o) for r, o in moved if o.reason is None])
                for replica, outcome in failed:
                    self.fleet.fence(replica, f"update_failed: {outcome.reason}")
                if current is not None:
                    await self.fleet.store.put_policy(current.encode())
                self.fleet.metrics.publishes.labels(result="failed").inc()
                names = "; ".join(f"{o.engine}: {o.reason}" for _, o in failed)
                raise PublishError(
                    502,
                    f"nothing was published, do not send the weights: {names} (the others "
                    "put their weights back and resumed; the failed ones are fenced)",
                    "publish_failed",
                    [o.as_json() for _, o in moved],
                )
            self.transfer = Transfer(target, current, moved, started, renew)
            kept = True
            self._idle(self.transfer)
            return {
                "version": version,
                "state": "receiving",
                "world_size": group.world_size,
                "replicas": [
                    {"engine": r.url, "rank_offset": group.ranks[r.url], "state": "receiving"}
                    for r in members
                ],
            }
        finally:
            if not kept:
                await self.fleet.release_fleet(renew)

    def _members(self, group: TransferGroup) -> list[Replica]:
        """The group's replicas, all of them reachable: a broadcast needs every rank."""
        replicas = {r.url: r for r in self.fleet.engine.replicas}
        missing = [url for url in group.ranks if url not in replicas]
        down = [url for url in group.ranks if url in replicas and not replicas[url].healthy]
        reason = group.broken or (
            f"{', '.join(missing + down)} gone or down" if missing or down else None
        )
        if reason is not None:
            raise PublishError(
                409,
                f"the transfer group is broken ({reason}): the trainer initialises a new one "
                "(GET /policy/transfer says its world size) and publishes again",
                "transfer_group_broken",
            )
        return [replicas[url] for url in group.ranks]

    async def _start_one(self, replica: Replica, pause: str, outcome: ReplicaOutcome) -> None:
        control = self._transfer_control(replica)
        begun = time.perf_counter()
        try:
            await control.pause(pause)
            outcome.steps["pause"] = time.perf_counter() - begun
            outcome.touched = True
            await control.start_update()
        except ControlError as error:
            outcome.reason = f"{error.step}: {error.reason}"
        finally:
            outcome.seconds = time.perf_counter() - begun

    async def _put_back(self, moved: list[tuple[Replica, ReplicaOutcome]]) -> None:
        """Members that started an update no weights came for: their old weights back
        (vLLM's finish without an update restores them), resumed; fenced if that fails."""

        async def one(replica: Replica, outcome: ReplicaOutcome) -> None:
            control = self._transfer_control(replica)
            try:
                await control.finish_update(None)
                await control.resume()
                self.fleet.state_of(replica.url).state = "serving"
            except ControlError as error:
                self.fleet.fence(replica, f"update_failed: {error}")

        await asyncio.gather(*(one(replica, outcome) for replica, outcome in moved))

    def _in_flight(self, step: str, *, updated: bool) -> Transfer:
        """The transfer waiting for `step`: an update (after the start or another update),
        or the finish (after an update); never while an update runs."""
        transfer = self.transfer
        if transfer is None or transfer.updating or (updated and not transfer.updated):
            expected = "after an update" if updated else "after the start (POST /policy)"
            raise PublishError(
                409,
                f"no transfer publish waits for {step} on this server ({step} comes "
                f"{expected}, one call at a time; every call of one publish goes to the "
                "same session server)",
                "no_transfer_in_flight",
            )
        if transfer.idle is not None:
            transfer.idle.cancel()
        return transfer

    async def update_transfer(self, update_info: dict[str, Any] | list[Any]) -> dict[str, Any]:
        """Every member receives the weights (vLLM's `/update_weights`, which blocks while
        the trainer broadcasts). A member that fails ends the publish at once: the trainer
        will not finish it (its broadcast or its update call failed), so the members that
        received everything are finished here and the rest fenced; the group is broken."""
        self._check_info(update_info=update_info)
        transfer = self._in_flight("update", updated=False)
        transfer.updated = transfer.updating = True
        try:
            await asyncio.gather(
                *(
                    self._update_one(replica, update_info, outcome)
                    for replica, outcome in transfer.moved
                )
            )
        finally:
            transfer.updating = False
        failed = [o for _, o in transfer.moved if o.reason is not None]
        if failed:
            if self.group is not None:
                self.group.broken = "an update failed: " + "; ".join(
                    f"{o.engine}: {o.reason}" for o in failed
                )
            return await self._finish(transfer)
        self._idle(transfer)
        return {
            "version": transfer.target.version,
            "state": "received",
            "replicas": [o.as_json() for _, o in transfer.moved],
        }

    async def _update_one(
        self, replica: Replica, update_info: dict[str, Any] | list[Any], outcome: ReplicaOutcome
    ) -> None:
        begun = time.perf_counter()
        try:
            await self._transfer_control(replica).update(update_info)
        except ControlError as error:
            outcome.reason = f"{error.step}: {error.reason}"
        finally:
            took = time.perf_counter() - begun
            outcome.steps["update"] = outcome.steps.get("update", 0.0) + took
            outcome.seconds += took

    async def finish_transfer(self) -> dict[str, Any]:
        """Every member processes the received weights and takes the version; then prefix
        caches dropped, checksums compared, the majority resumed, the policy stored."""
        return await self._finish(self._in_flight("finish", updated=True))

    async def _finish(self, transfer: Transfer) -> dict[str, Any]:
        target = transfer.target
        try:
            await asyncio.gather(
                *(
                    self._finish_one(replica, target, outcome)
                    for replica, outcome in transfer.moved
                    if outcome.reason is None
                )
            )
            members = {replica.url for replica, _ in transfer.moved}
            outside = []
            for replica in self.fleet.engine.replicas:
                if replica.url not in members:
                    reason = f"{AWAITING_TRANSFER}: not in the transfer group, {RESEND}"
                    self.fleet.fence(replica, reason)
                    outside.append({"engine": replica.url, "state": "fenced", "reason": reason})
            return await self.fleet.conclude(target, transfer.moved, transfer.started, outside)
        finally:
            self.transfer = None
            await self.fleet.release_fleet(transfer.renew)

    async def _finish_one(
        self, replica: Replica, target: PublishedPolicy, outcome: ReplicaOutcome
    ) -> None:
        control = self._transfer_control(replica)
        begun = time.perf_counter()
        try:
            await control.finish_update(target.version)
            # As after a folder reload: a `keep` pause's frozen requests recompute.
            _, outcome.checksum = await asyncio.gather(
                control.drop_prefix_cache(running=target.pause == "keep"), control.checksum()
            )
            outcome.version = target.version
        except ControlError as error:
            outcome.reason = f"{error.step}: {error.reason}"
        finally:
            outcome.steps["finish, cache, checksum"] = time.perf_counter() - begun
            outcome.seconds += outcome.steps["finish, cache, checksum"]

    def _idle(self, transfer: Transfer) -> None:
        """End a transfer whose trainer stops calling: before the weights came, the members
        put their old weights back; after, the publish is finished as the trainer began it."""

        async def end() -> None:
            await asyncio.sleep(TRANSFER_IDLE_S)
            transfer.idle = None
            logger.warning("transfer of %s abandoned by the trainer", transfer.target.version)
            if transfer.updated:
                try:
                    await self._finish(transfer)
                except PublishError as error:
                    logger.warning("abandoned transfer finished with errors: %s", error.message)
                return
            try:
                await self._put_back(transfer.moved)
                if transfer.previous is not None:
                    await self.fleet.store.put_policy(transfer.previous.encode())
            finally:
                self.transfer = None
                await self.fleet.release_fleet(transfer.renew)

        transfer.idle = asyncio.create_task(end(), name="policy-transfer-idle")


def _transfer_running(transfer: Transfer) -> PublishError:
    return PublishError(
        409,
        f"a transfer publish of version {transfer.target.version} is in flight",
        "publish_in_progress",
    )
