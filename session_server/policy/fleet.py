"""The engine fleet's policy: publish a checkpoint to every replica (`POST /policy`), and keep
turns off any replica that does not serve the published policy.

A publish (one server at a time: the store's `policy` lease):
1. the checkpoint is checked against the served model (headers only) before any engine is
   touched;
2. every replica, in parallel: pause (keep / wait / abort), reload in place, drop the prefix
   cache, set the version, checksum;
3. the checksums are compared; the replicas that agree with the majority resume, any other is
   left paused and fenced;
4. the policy is stored, and every session server follows it.

A failed replica does not roll the others back: the old weights may exist nowhere (the trainer
wrote over them, or they were the base model the pod started from), and the replicas that did
move serve exactly the published policy. The failed one is fenced (gets no turns) and, for a
checkpoint folder, reloaded from it by whichever server takes its catch-up lease, before it
gets a turn again.

Following (every server, every health round): a replica whose `/weight_info` version is not
the published one is fenced ("behind") and, for a folder source, caught up (for a policy the
trainer sent, `policy/transfer.py`, it stays fenced, "awaiting_transfer"); a replica at the
published version whose checksum differs from the publish's is fenced ("checksum"); a replica
that appears or is marked down is fenced ("new") until it has been checked. The engine client
also refuses a generation stamped with a version older than the published one, so a replica
restarted between two health rounds cannot slip a turn of the base weights in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from session_server.engine_wire.base import Replica
from session_server.engines import EngineClient
from session_server.metrics import Metrics
from session_server.policy.checkpoint import CheckpointError, Layout, check_fits, read_layout
from session_server.policy.control import (
    ControlError,
    EngineControl,
    control_class,
    control_for,
)
from session_server.policy.state import PublishedPolicy, not_newer
from session_server.store.base import SessionStore

logger = logging.getLogger(__name__)

PUBLISH_LEASE = "policy"
# A publish holds its lease this long at most (renewed while it runs); a server that dies
# mid-publish blocks the next one for no longer.
PUBLISH_LEASE_S = 60.0
CATCH_UP_LEASE_S = 120.0


class PublishError(Exception):
    """A publish refused or failed; `status` is the HTTP status, `replicas` what each replica
    did (empty when no engine was touched)."""

    def __init__(
        self, status: int, message: str, kind: str, replicas: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.replicas = replicas or []


@dataclass(slots=True)
class ReplicaPolicy:
    """What this server knows of one replica's policy (beside `Replica.fenced`)."""

    state: str = "serving"
    checksum: str | None = None
    checked: tuple[str, float] | None = None
    """(version, published_at) its checksum was last compared for."""
    catching_up: asyncio.Task[None] | None = field(default=None, repr=False)


@dataclass(slots=True)
class ReplicaOutcome:
    engine: str
    version: str | None = None
    state: str = "updating"
    seconds: float = 0.0
    checksum: str | None = None
    reason: str | None = None
    touched: bool = False
    """Whether its weights were (maybe) changed: a reload was sent."""
    inflight: int = 0
    steps: dict[str, float] = field(default_factory=dict)
    """Seconds per step (pause; reload; cache, version and checksum, sent together): the
    engine's own work beside the control plane's."""

    def as_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "version": self.version,
            "state": self.state,
            "seconds": round(self.seconds, 3),
            "checksum": self.checksum,
            "reason": self.reason,
            "steps": {step: round(seconds, 3) for step, seconds in self.steps.items()},
        }


class PolicyFleet:
    def __init__(
        self,
        engine: EngineClient,
        store: SessionStore,
        metrics: Metrics,
        *,
        served_model: str | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.served_model = served_model
        """A local folder holding the served model (`--tokenizer` where it is one): the
        layout a first checkpoint is checked against."""
        self.interval_s = interval_s
        self.owner = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(4).hex()}"
        self.published: PublishedPolicy | None = None
        self.replicas: dict[str, ReplicaPolicy] = {}
        self._task: asyncio.Task[None] | None = None
        self._publishing = False
        engine.on_replica_unverified.append(self._unverified)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(Exception):  # the store may be down at start; follow retries
            await self.refresh()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="policy-follow")

    async def close(self) -> None:
        tasks = [r.catching_up for r in self.replicas.values() if r.catching_up is not None]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.follow()
            except Exception:  # the loop must outlive any single bad round
                logger.exception("policy follow round failed")

    def state_of(self, url: str) -> ReplicaPolicy:
        return self.replicas.setdefault(url, ReplicaPolicy())

    def _unverified(self, replica: Replica) -> None:
        if self.published is not None:
            replica.fenced = "new: not yet checked against the published policy"
            state = self.state_of(replica.url)
            state.state = "fenced"
            state.checked = None  # maybe restarted: its checksum is read again

    # --- following ----------------------------------------------------------------------------

    async def refresh(self) -> None:
        document = await self.store.get_policy()
        self._follow_policy(None if document is None else PublishedPolicy.decode(document))

    def _follow_policy(self, published: PublishedPolicy | None) -> None:
        self.published = published
        self.engine.published_version = None if published is None else published.version
        self.engine.accepts_version = None if published is None else published.accepts

    async def follow(self) -> None:
        """One round: read the published policy, then fence, unfence or catch up each
        replica by what it reports."""
        await self.refresh()
        published = self.published
        if published is None or self._publishing:
            return
        await asyncio.gather(
            *(self._follow_one(replica, published) for replica in self.engine.replicas)
        )

    async def _follow_one(self, replica: Replica, published: PublishedPolicy) -> None:
        state = self.state_of(replica.url)
        if state.catching_up is not None or not replica.healthy:
            return
        version = replica.weight_version
        control = self.control(replica)
        if version is None or not published.accepts(version) or replica.fenced is not None:
            # The health round's reading may predate the publish this server just read, or
            # (a fenced replica, one that just came back) the engine's restart: a replica
            # restarted on its base weights must not be unfenced on its old reading.
            with contextlib.suppress(ControlError):
                version = replica.weight_version = await control.version()
        if version is None or not published.accepts(version):
            if published.path is None:
                # Only the trainer has the weights of a transfer: it must send them again.
                self.fence(replica, f"{AWAITING_TRANSFER}: serves {version}, {RESEND}")
                return
            self.fence(replica, f"behind: serves {version}, published {published.version}")
            if published.pending is None:
                state.catching_up = asyncio.create_task(self._catch_up(replica))
            return
        if version != published.version:
            return  # being published by another server, which stores it when done
        if state.checked != (version, published.published_at):
            try:
                state.checksum = await control.checksum()
            except ControlError as error:
                self.fence(replica, f"checksum: {error.reason}")
                return
            state.checked = (version, published.published_at)
        if published.checksum is not None and state.checksum != published.checksum:
            self.fence(
                replica, f"checksum: {state.checksum}, the publish's is {published.checksum}"
            )
            return
        if replica.fenced is not None:
            # A replica whose publish failed after its pause may still be paused.
            try:
                await control.resume()
            except ControlError as error:
                self.fence(replica, f"update_failed: {error}")
                return
            logger.warning("engine %s serves policy %s again", replica.url, version)
        replica.fenced = None
        state.state = "serving"

    def fence(self, replica: Replica, reason: str) -> None:
        if replica.fenced != reason:
            logger.warning("engine %s fenced: %s", replica.url, reason)
        replica.fenced = reason
        self.state_of(replica.url).state = "behind" if reason.startswith("behind") else "fenced"

    async def _catch_up(self, replica: Replica) -> None:
        """Reload a replica that is behind from the published folder. Under the policy
        lease, as a publish: one fleet-wide job at a time, so a catch-up never races a
        publish (or another server's catch-up) on the same replica."""
        state = self.state_of(replica.url)
        try:
            if not await self.store.claim_lease(PUBLISH_LEASE, self.owner, CATCH_UP_LEASE_S):
                return
            try:
                await self.refresh()
                published = self.published
                control = self.control(replica)
                if published is None or published.path is None:
                    return
                if (await control.version()) == published.version:
                    return  # caught up meanwhile; the next round checks its checksum
                outcome = ReplicaOutcome(replica.url)
                await self._update(replica, published, "abort", outcome)
                await control.resume()
                replica.weight_version = published.version
                state.checksum = outcome.checksum
                state.checked = (published.version, published.published_at)
                self.metrics.publish_replica_seconds.labels(replica=replica.url).observe(
                    outcome.seconds
                )
                if published.checksum is not None and outcome.checksum != published.checksum:
                    # Resumed, but fenced: it serves nothing until a publish brings it back.
                    self.fence(replica, f"checksum: {outcome.checksum} after catch-up")
                    self.metrics.catch_ups.labels(result="checksum").inc()
                    return
                replica.fenced = None
                state.state = "serving"
                self.metrics.catch_ups.labels(result="ok").inc()
                logger.warning(
                    "engine %s caught up to policy %s in %.2fs",
                    replica.url,
                    published.version,
                    outcome.seconds,
                )
            finally:
                await self.store.release_lease(PUBLISH_LEASE, self.owner)
        except ControlError as error:
            self.metrics.catch_ups.labels(result="failed").inc()
            self.fence(replica, f"behind: catch-up failed: {error}")
        except Exception:
            logger.exception("catch-up of %s failed", replica.url)
        finally:
            state.catching_up = None

    # --- publishing ---------------------------------------------------------------------------

    def control(self, replica: Replica) -> EngineControl:
        return control_for(self.engine.wire.kind, self.engine.control_http, replica.url)

    def _check_checkpoint(self, path: str) -> None:
        candidate = read_layout(path)
        reference = self._reference_layout()
        if reference is not None:
            check_fits(candidate, reference)

    def _reference_layout(self) -> Layout | None:
        """The served model's layout: the last published folder, else the served model's."""
        for folder in (self.published.path if self.published else None, self.served_model):
            if folder and Path(folder).is_dir() and any(Path(folder).glob("*.safetensors")):
                with contextlib.suppress(CheckpointError):
                    return read_layout(folder)
        return None

    def check_engine(self, pause: str, *, transfer: bool = False) -> None:
        kind = self.engine.wire.kind
        try:
            control = control_class(kind)
        except ValueError:
            raise PublishError(
                501, f"publishing to {kind} engines is not built", "not_supported"
            ) from None
        if transfer and not control.transfers:
            raise PublishError(
                501,
                f"{kind} engines take no weight transfer from tokenkeep: publish a checkpoint "
                'folder with {"source": {"path": DIR}}',
                "not_supported",
            )
        modes = control.transfer_pause_modes if transfer else control.pause_modes
        if pause not in modes:
            # Refused before any engine is touched, rather than honoured as another mode.
            raise PublishError(
                501,
                f"{kind} engines cannot honour pause {pause!r}: use one of {', '.join(modes)}",
                "pause_not_supported",
            )

    async def publish(
        self, version: str, path: str, pause: str, *, force: bool = False
    ) -> dict[str, Any]:
        self.check_engine(pause)
        renew = await self.take_fleet()
        try:
            current = await self.current_for(version, force)
            try:
                await asyncio.to_thread(self._check_checkpoint, path)
            except CheckpointError as error:
                self.metrics.publishes.labels(result="refused").inc()
                raise PublishError(error.status, error.message, "bad_checkpoint") from None
            if current is not None:  # followers: replicas already at `version` are not behind
                pending = dataclasses.replace(current, pending=version)
                await self.store.put_policy(pending.encode())
            try:
                return await self._fan_out(version, path, pause)
            finally:
                if current is not None and self.published is current:  # nothing touched
                    await self.store.put_policy(current.encode())
        finally:
            await self.release_fleet(renew)

    async def take_fleet(self) -> asyncio.Task[None]:
        """Drive the fleet: refused while this server drives it already (a publish, a
        transfer between its calls, a group forming), else after the policy lease (another
        server's publish or a catch-up ends first). Returns the lease's renewal."""
        if self._publishing:
            raise PublishError(
                409,
                "this server is publishing (a transfer publish between its calls included) or "
                "forming a transfer group",
                "publish_in_progress",
            )
        self._publishing = True
        try:
            if not await self._wait_for_lease():
                raise _lease_busy()
        except BaseException:
            self._publishing = False
            raise
        return asyncio.create_task(self._renew(PUBLISH_LEASE, PUBLISH_LEASE_S))

    async def release_fleet(self, renew: asyncio.Task[None]) -> None:
        self._publishing = False
        await stop_task(renew)
        await self.store.release_lease(PUBLISH_LEASE, self.owner)

    async def current_for(self, version: str, force: bool) -> PublishedPolicy | None:
        """The published policy, once `version` is known to be newer (or forced)."""
        await self.refresh()
        current = self.published
        if current is not None and not force and not_newer(version, current.version):
            raise PublishError(
                409,
                f"version {version} is not newer than the published {current.version}; "
                'send "force": true to publish it anyway',
                "version_not_newer",
            )
        return current

    async def _wait_for_lease(self) -> bool:
        """Take the policy lease, waiting for a catch-up or another server's publish to end
        (up to the lease's own lifetime)."""
        deadline = time.monotonic() + PUBLISH_LEASE_S
        while not await self.store.claim_lease(PUBLISH_LEASE, self.owner, PUBLISH_LEASE_S):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _renew(self, lease: str, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            with contextlib.suppress(Exception):
                await self.store.claim_lease(lease, self.owner, ttl_s)

    async def _fan_out(self, version: str, path: str, pause: str) -> dict[str, Any]:
        target = PublishedPolicy(version, {"path": path}, time.time(), pause, None)
        replicas = self.engine.replicas
        outcomes = [ReplicaOutcome(r.url, inflight=r.inflight) for r in replicas]
        for replica in replicas:
            self.state_of(replica.url).state = "updating"
        started = time.perf_counter()
        await asyncio.gather(
            *(
                self._update_or_fence(replica, target, pause, outcome)
                for replica, outcome in zip(replicas, outcomes, strict=True)
            )
        )
        return await self.conclude(target, list(zip(replicas, outcomes, strict=True)), started)

    async def conclude(
        self,
        target: PublishedPolicy,
        moved: list[tuple[Replica, ReplicaOutcome]],
        started: float,
        outside: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """After the replicas' updates: compare checksums, resume the majority, fence the
        rest, store the policy (once any replica was touched) and answer (or raise)."""
        version, pause, source = target.version, target.pause, target.source
        outcomes = [outcome for _, outcome in moved]
        done = [o for o in outcomes if o.reason is None]
        majority = Counter(o.checksum for o in done).most_common(1)
        checksum = majority[0][0] if majority else None
        for replica, outcome in moved:
            if outcome.reason is None and outcome.checksum != checksum:
                outcome.reason = f"checksum {outcome.checksum} differs from {checksum}"
                self.fence(replica, f"checksum: {outcome.reason}")
        resumed = [
            (replica, outcome)
            for replica, outcome in moved
            if outcome.reason is None or not outcome.touched
        ]
        await asyncio.gather(*(self._resume(replica, outcome) for replica, outcome in resumed))
        pause_s = time.perf_counter() - started
        touched = any(o.touched for o in outcomes)
        if touched:
            published = PublishedPolicy(version, source, target.published_at, pause, checksum)
            await self.store.put_policy(published.encode())
            self._follow_policy(published)
        for replica, outcome in moved:
            state = self.state_of(replica.url)
            if outcome.reason is None:
                outcome.state = "serving"
                replica.fenced = None
                replica.weight_version = version
                state.state, state.checksum = "serving", outcome.checksum
                state.checked = (version, target.published_at)
            elif touched:
                outcome.state = "fenced"
                self.fence(replica, f"update_failed: {outcome.reason}")
            else:
                outcome.state = state.state = "serving"
            self.metrics.publish_replica_seconds.labels(replica=replica.url).observe(
                outcome.seconds
            )
        self.metrics.publish_pause_seconds.labels(mode=pause).observe(pause_s)
        self.metrics.publish_requests.labels(mode=pause).inc(sum(o.inflight for o in outcomes))
        failed = [o for o in outcomes if o.reason is not None]
        result = "ok" if not failed else ("partial" if done else "failed")
        self.metrics.publishes.labels(result=result).inc()
        answer = {
            "version": version,
            "source": source,
            "pause": pause,
            "pause_seconds": round(pause_s, 3),
            "requests": {_PAUSED_AS[pause]: sum(o.inflight for o in outcomes)},
            "published": touched,
            "replicas": [o.as_json() for o in outcomes] + (outside or []),
        }
        if failed:
            names = "; ".join(f"{o.engine}: {o.reason}" for o in failed)
            status = 504 if all("timed out" in (o.reason or "") for o in failed) else 502
            fate = (
                f"published to {len(done)} of {len(outcomes)} replicas; the others are fenced"
                if touched
                else "nothing was published"
            )
            raise PublishError(status, f"{fate}: {names}", "publish_failed", answer["replicas"])
        return answer

    async def _update_or_fence(
        self, replica: Replica, target: PublishedPolicy, pause: str, outcome: ReplicaOutcome
    ) -> None:
        try:
            await self._update(replica, target, pause, outcome)
        except ControlError as error:
            outcome.reason = f"{error.step}: {error.reason}"

    async def _update(
        self, replica: Replica, target: PublishedPolicy, pause: str, outcome: ReplicaOutcome
    ) -> None:
        """Pause, reload, drop the prefix cache, set the version, checksum: the replica is
        left paused (the caller resumes it once the checksums agree)."""
        assert target.path is not None
        control = self.control(replica)
        started = time.perf_counter()

        def lap(step: str) -> None:
            outcome.steps[step] = time.perf_counter() - started - sum(outcome.steps.values())

        try:
            await control.pause(pause)
            lap("pause")
            outcome.touched = True
            reloaded = await control.reload(target.path, target.version)
            lap("reload")
            if reloaded.get("tied") and (reloaded.get("lm_head_vs_checkpoint") or 0) != 0:
                raise ControlError(
                    replica.url, "reload", f"tied output layer off the checkpoint: {reloaded}"
                )
            # Independent of each other once the weights are in, so sent together. A `keep`
            # pause leaves its frozen requests' blocks in the cache: they are recomputed by
            # the new weights rather than reused.
            _, _, outcome.checksum = await asyncio.gather(
                control.drop_prefix_cache(running=pause == "keep"),
                control.set_version(target.version),
                control.checksum(),
            )
            lap("cache, version, checksum")
            outcome.version = target.version
        finally:
            outcome.seconds = time.perf_counter() - started

    async def _resume(self, replica: Replica, outcome: ReplicaOutcome) -> None:
        try:
            await self.control(replica).resume()
        except ControlError as error:
            if outcome.reason is None:
                outcome.reason = f"{error.step}: {error.reason}"

    # --- reading ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        published = self.published
        replicas = []
        for replica in self.engine.replicas:
            state = self.state_of(replica.url)
            if replica.fenced is not None:
                shown = "behind" if replica.fenced.startswith("behind") else "fenced"
            else:
                shown = "updating" if state.state == "updating" else "serving"
            replicas.append(
                {
                    "engine": replica.url,
                    "version": replica.weight_version,
                    "state": shown,
                    "reason": replica.fenced,
                    "checksum": state.checksum,
                    "healthy": replica.healthy,
                    # Set where its tokenizer keeps it from serving (tokenizer_match.py).
                    "tokenizer": replica.tokenizer_differs,
                }
            )
        return {
            "version": None if published is None else published.version,
            "source": None if published is None else published.source,
            "published_at": None if published is None else published.published_at,
            "pause": None if published is None else published.pause,
            "checksum": None if published is None else published.checksum,
            "replicas": replicas,
        }


_PAUSED_AS = {"keep": "kept", "wait": "waited", "abort": "aborted"}
AWAITING_TRANSFER = "awaiting_transfer"
"""The fence reason (and metric label) of a replica behind a policy sent by weight transfer."""
RESEND = (
    "the published policy came by weight transfer: tokenkeep cannot reload it, the trainer's "
    "next publish sends it (after a new transfer group, if it left the old one)"
)


async def stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _lease_busy() -> PublishError:
    return PublishError(
        409,
        f"another publish or catch-up held the fleet for {PUBLISH_LEASE_S:g}s; retry",
        "publish_in_progress",
    )
