"""Kopf handlers: thin bindings from watch events to `Reconciler` methods.

The custom resources are reconciled on create, update and resume; their status is refreshed
whenever a child they own changes (Deployments, StatefulSets, pods, claims: found through the
owner label every child and pod carries). No finalizers: every child is garbage-collected
through its owner reference, so deleting a resource never waits for the operator. (That is
also why there are no Kopf timers here: Kopf puts a finalizer on every resource a timer runs
for.)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from tokenkeep_operator import __version__
from tokenkeep_operator.kube import Kube, load_config
from tokenkeep_operator.manifests.common import MANAGED_BY
from tokenkeep_operator.models import GROUP, VERSION
from tokenkeep_operator.reconcile import ApplyError, Reconciler

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
OWNER_LABELS = {f"{GROUP}/modelserver": "ModelServer", f"{GROUP}/sessionserver": "SessionServer"}
APPLY_RETRY_SECONDS = 60


def _post_event(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(obj, type=type_, reason=reason, message=message[:1024])


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Handler progress in annotations, so that status holds only what the CRD schema declares.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Kopf would post an event per handler log line; the conditions' events are enough.
    settings.posting.level = logging.WARNING
    image = os.environ.get("TOKENKEEP_IMAGE") or f"tokenkeep/tokenkeep:{__version__}"
    memo.reconciler = Reconciler(Kube(load_config()), _post_event, default_image=image)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster first, else $KUBECONFIG as it is now (the client library's own login
    reads $KUBECONFIG once, at import)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _reconcile(action: Any, namespace: str, name: str) -> None:
    try:
        action(namespace, name)
    except ApplyError as error:
        # Already recorded as Degraded/ApplyFailed; try again later rather than hot-looping.
        raise kopf.TemporaryError(str(error), delay=APPLY_RETRY_SECONDS) from error


@kopf.on.resume(GROUP, VERSION, "modelservers")
@kopf.on.create(GROUP, VERSION, "modelservers")
@kopf.on.update(GROUP, VERSION, "modelservers")
def model_server_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    _reconcile(memo.reconciler.reconcile_model_server, namespace, name)


@kopf.on.resume(GROUP, VERSION, "sessionservers")
@kopf.on.create(GROUP, VERSION, "sessionservers")
@kopf.on.update(GROUP, VERSION, "sessionservers")
def session_server_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    _reconcile(memo.reconciler.reconcile_session_server, namespace, name)


@kopf.on.event(GROUP, VERSION, "modelservers")
def model_server_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A SessionServer follows its ModelServer: one created late unblocks it, a changed
    served name reconfigures it, and its readiness explains the session server's."""
    for session_server in memo.reconciler.session_servers_using(namespace, name):
        _reconcile(memo.reconciler.reconcile_session_server, namespace, session_server)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED)
@kopf.on.event("v1", "pods", labels=MANAGED)
@kopf.on.event("v1", "persistentvolumeclaims", labels=MANAGED)
def child_changed(labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any) -> None:
    for label, kind in OWNER_LABELS.items():
        owner = labels.get(label)
        if owner and kind == "ModelServer":
            memo.reconciler.refresh_model_server(namespace, owner)
        elif owner:
            memo.reconciler.refresh_session_server(namespace, owner)
