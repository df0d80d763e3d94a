"""One active operator at a time: leader election on a coordination.k8s.io Lease.

The same protocol as client-go's leader election: the holder renews the Lease every
`duration / 3` seconds; a candidate takes it over only after it has seen the same record,
unrenewed, for a whole `duration` of its own clock (so clock skew between nodes does not
matter). Updates carry the resourceVersion they read, so two candidates never both win. A
holder that cannot renew for `duration` stops working (its caller exits, and a restarted
process is a candidate again). A holder that stops cleanly releases the Lease so that a
standby takes over at once.

A standby makes no watches and no writes except its Lease reads: it is passive.

A Lease the operator is forbidden to read or write (RBAC: 403) is not a standby: the error
names the namespace and the verb, is logged once, and after `forbidden_timeout` seconds
(RBAC created alongside the Deployment may take a moment to apply) `LeaseForbidden` ends the
wait, so the process exits non-zero instead of waiting forever.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiException
from urllib3.exceptions import HTTPError

from tokenkeep_operator.kube import Kube, error_message

logger = logging.getLogger(__name__)


class LeaseForbidden(Exception):
    """RBAC forbids this operator a verb on its Lease (HTTP 403)."""

    def __init__(self, namespace: str, name: str, verb: str, message: str) -> None:
        super().__init__(
            f"forbidden to {verb} Lease {namespace}/{name} (coordination.k8s.io): {message}; "
            f"grant the operator's ServiceAccount get, create and update on leases in "
            f"namespace {namespace!r}, or pass --lease-namespace"
        )
        self.namespace = namespace
        self.verb = verb


def _micro_time() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity() -> str:
    return f"{socket.gethostname()}-{threading.get_native_id()}-{time.time_ns() % 10**6}"


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        *,
        identity: str | None = None,
        duration: float = 15.0,
        forbidden_timeout: float = 30.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.duration = duration
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self.renewed_at = 0.0
        self.forbidden_timeout = forbidden_timeout
        self.forbidden: LeaseForbidden | None = None
        """The last attempt's 403, None once an attempt was allowed."""

    def _lease(self, spec: dict[str, Any], live: dict[str, Any] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if live is not None:
            meta["resourceVersion"] = live["metadata"]["resourceVersion"]
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": spec,
        }

    def try_acquire_or_renew(self) -> bool:
        now = time.monotonic()
        stamp = _micro_time()
        verb = "get"
        try:
            live = self.kube.get("coordination.k8s.io/v1", "Lease", self.namespace, self.name)
            if live is None:
                spec = {
                    "holderIdentity": self.identity,
                    "leaseDurationSeconds": max(1, round(self.duration)),
                    "acquireTime": stamp,
                    "renewTime": stamp,
                    "leaseTransitions": 0,
                }
                verb = "create"
                self.kube.create(self._lease(spec))
                self.renewed_at = now
                self.forbidden = None
                return True
            spec = dict(live.get("spec") or {})
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
            if record != self._observed:
                self._observed, self._observed_at = record, now
            if holder and holder != self.identity:
                held_for = spec.get("leaseDurationSeconds") or self.duration
                if now - self._observed_at < held_for:
                    return False
            if holder != self.identity:
                spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
                spec["acquireTime"] = stamp
            spec.update(
                holderIdentity=self.identity,
                leaseDurationSeconds=max(1, round(self.duration)),
                renewTime=stamp,
            )
            verb = "update"
            self.kube.replace(self._lease(spec, live))
            self.renewed_at = now
            self.forbidden = None
            return True
        except ApiException as error:
            if error.status == 403:
                first = self.forbidden is None
                self.forbidden = LeaseForbidden(
                    self.namespace, self.name, verb, error_message(error)
                )
                if first:
                    logger.error("lease: %s", self.forbidden)
                return False
            self.forbidden = None
            if error.status != 409:
                logger.warning("lease %s/%s: %s", self.namespace, self.name, error_message(error))
            return False
        except (HTTPError, OSError) as error:  # the API server is unreachable: try again
            self.forbidden = None
            logger.warning("lease %s/%s: %s", self.namespace, self.name, error)
            return False

    def wait_for_leadership(self, stop: threading.Event) -> bool:
        """Block until this process holds the Lease (True) or `stop` is set (False). Raises
        `LeaseForbidden` once RBAC has refused the Lease for `forbidden_timeout` seconds."""
        announced = False
        forbidden_since: float | None = None
        while not stop.is_set():
            if self.try_acquire_or_renew():
                logger.info(
                    "leading: lease %s/%s acquired as %s", self.namespace, self.name, self.identity
                )
                return True
            if self.forbidden is not None:
                now = time.monotonic()
                forbidden_since = now if forbidden_since is None else forbidden_since
                if now - forbidden_since >= self.forbidden_timeout:
                    raise self.forbidden
                stop.wait(min(self.duration / 5, self.forbidden_timeout))
                continue
            forbidden_since = None
            if not announced:
                holder = self._observed[0] if self._observed else "?"
                logger.info("standby: lease %s/%s is held by %s", self.namespace, self.name, holder)
                announced = True
            stop.wait(self.duration / 5)
        return False

    def keep_renewing(
        self, stop: threading.Event, lost: threading.Event, on_lost: Callable[[], None]
    ) -> None:
        """Renew until `stop`; once renewal failed for `duration` or another candidate holds
        the Lease, set `lost`, call `on_lost` and return."""
        while not stop.wait(self.duration / 3):
            if self.try_acquire_or_renew():
                continue
            if time.monotonic() - self.renewed_at >= self.duration or self._held_by_other():
                logger.error("lease %s/%s lost; stopping", self.namespace, self.name)
                lost.set()
                on_lost()
                return

    def _held_by_other(self) -> bool:
        return bool(self._observed and self._observed[0] not in ("", self.identity))

    def release(self) -> None:
        """Give the Lease up so a standby takes over without waiting for it to expire."""
        try:
            live = self.kube.get("coordination.k8s.io/v1", "Lease", self.namespace, self.name)
            if live and (live.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**live["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
                self.kube.replace(self._lease(spec, live))
        except ApiException as error:
            logger.warning(
                "lease %s/%s not released: %s", self.namespace, self.name, error_message(error)
            )
