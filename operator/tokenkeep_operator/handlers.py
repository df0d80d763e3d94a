"""Kopf handlers: thin bindings from watch events to the work queue.

Every event of a ModelServer or SessionServer, and of any child the operator owns (found by
the owner label every child and pod carries), queues a reconcile of its owner: the children
are re-applied where they differ from the rendering (so a hand edit or a deleted child is
undone within seconds) and the status is recomputed. The queue debounces bursts and retries
failures with backoff (see `workqueue.py`).

No finalizers: every child is garbage-collected through its owner reference, so deleting a
resource never waits for the operator. (That is also why there are no Kopf timers or
create/update handlers here: timers put a finalizer on every resource, and create/update
handlers write their progress into the resource.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable
from typing import Any

import kopf

from tokenkeep_operator import __version__
from tokenkeep_operator.kube import Kube, load_config
from tokenkeep_operator.manifests.common import MANAGED_BY
from tokenkeep_operator.models import GROUP, VERSION
from tokenkeep_operator.reconcile import Reconciler
from tokenkeep_operator.workqueue import WorkQueue

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
OWNER_LABELS = {f"{GROUP}/modelserver": "ModelServer", f"{GROUP}/sessionserver": "SessionServer"}
# Work-queue key kind: every SessionServer that uses the named ModelServer.
USERS_OF = "SessionServersOf"
# Seconds of quiet before a burst of child events becomes one reconcile.
DEBOUNCE_SECONDS = float(os.environ.get("TOKENKEEP_OPERATOR_DEBOUNCE_SECONDS", "1"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # The operator posts its own Events (one per change of state); Kopf's only for errors.
    settings.posting.level = logging.ERROR
    image = os.environ.get("TOKENKEEP_IMAGE") or f"tokenkeep/tokenkeep:{__version__}"
    reconciler = Reconciler(Kube(load_config()), default_image=image)

    def work(key: Hashable) -> float | None:
        """Reconcile; a SessionServer asks to be polled again (its published policy)."""
        kind, namespace, name = key  # type: ignore[misc]
        if kind == USERS_OF:
            for session_server in reconciler.session_servers_using(namespace, name):
                reconciler.reconcile("SessionServer", namespace, session_server)
            return None
        return reconciler.reconcile(kind, namespace, name)

    memo.reconciler = reconciler
    memo.queue = WorkQueue(work, debounce=DEBOUNCE_SECONDS)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster first, else $KUBECONFIG as it is now (the client library's own login
    reads $KUBECONFIG once, at import)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


# The handlers are coroutines: the queue lives on Kopf's event loop.


@kopf.on.event(GROUP, VERSION, "modelservers")
async def model_server_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A SessionServer follows its ModelServer: one created late unblocks it, a changed
    served name reconfigures it, and its readiness explains the session server's."""
    memo.queue.add(("ModelServer", namespace, name))
    memo.queue.add((USERS_OF, namespace, name))


@kopf.on.event(GROUP, VERSION, "sessionservers")
async def session_server_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.queue.add(("SessionServer", namespace, name))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED)
@kopf.on.event("v1", "pods", labels=MANAGED)
@kopf.on.event("v1", "persistentvolumeclaims", labels=MANAGED)
@kopf.on.event("v1", "services", labels=MANAGED)
@kopf.on.event("v1", "configmaps", labels=MANAGED)
@kopf.on.event("v1", "serviceaccounts", labels=MANAGED)
@kopf.on.event("policy", "poddisruptionbudgets", labels=MANAGED)
@kopf.on.event("networking.k8s.io", "networkpolicies", labels=MANAGED)
# A multi-node engine's status. Where its CRD is not installed Kopf serves the others and
# starts watching this one once the CRD appears.
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=MANAGED)
async def child_changed(labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any) -> None:
    for label, kind in OWNER_LABELS.items():
        owner = labels.get(label)
        if owner:
            memo.queue.add((kind, namespace, owner))
