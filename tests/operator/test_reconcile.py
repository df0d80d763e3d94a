"""Reconciler paths that the end-to-end tests cannot provoke through the fake API server."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client import ApiException

from tests.operator.conftest import load_example
from tokenkeep_operator.reconcile import ApplyError, Reconciler


class RefusingKube:
    """A stand-in for `Kube` (test double): holds one ModelServer, refuses to create
    Deployments (as a quota or admission webhook would), records status writes."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.status_writes: list[dict[str, Any]] = []

    def get_custom(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.body

    def get(self, *_: Any) -> None:
        return None

    def list(self, *_: Any, **__: Any) -> list[dict[str, Any]]:
        return []

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Deployment":
            raise ApiException(status=403, reason="Forbidden")
        return obj

    def patch_status(self, kind: str, namespace: str, name: str, status: dict) -> dict:
        self.status_writes.append(status)
        self.body = {**self.body, "status": status}
        return self.body


def test_refused_child_is_reported_as_apply_failed_and_stays_until_applied() -> None:
    body = load_example("modelserver-qwen3-8b.yaml")
    body["metadata"].update(namespace="rl", uid="u1", generation=3)
    kube = RefusingKube(body)
    events: list[tuple[str, str]] = []
    reconciler = Reconciler(
        kube,  # type: ignore[arg-type]
        lambda obj, type_, reason, message: events.append((type_, reason)),
        default_image="img",
        clock=lambda: "2026-01-01T00:00:00Z",
    )
    with pytest.raises(ApplyError, match="Deployment qwen3-8b-engine: Forbidden"):
        reconciler.reconcile_model_server("rl", "qwen3-8b")
    degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert ("Warning", "ApplyFailed") in events

    # A later status refresh (a child event) keeps reporting it: generation 3 never applied.
    reconciler.refresh_model_server("rl", "qwen3-8b")
    degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyFailed"
