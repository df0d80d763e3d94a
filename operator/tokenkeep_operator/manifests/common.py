"""Names, labels and metadata shared by every child object the operator renders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenkeep_operator.models import GROUP

MANAGED_BY = "tokenkeep-operator"
GENERATION_ANNOTATION = f"{GROUP}/generation"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
# Pod labels the engines' NetworkPolicy admits, each with a ModelServer's name as its value:
# the operator puts the first on the pods of every SessionServer that uses that ModelServer;
# users put the second on a trainer's pods (weight updates go to the engines directly).
USES_MODEL_SERVER_LABEL = f"{GROUP}/uses-modelserver"
TRAINER_LABEL = f"{GROUP}/trainer"
NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"
# Seconds a stopping pod keeps running before it gets SIGTERM, so that its removal from
# Service endpoints (and from the session server's DNS view) lands before it stops accepting.
ENDPOINT_PROPAGATION_SECONDS = 10


@dataclass(frozen=True)
class Owner:
    """The custom resource that owns the rendered children."""

    api_version: str
    kind: str
    name: str
    namespace: str
    uid: str
    generation: int

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    @property
    def label_key(self) -> str:
        """`tokenkeep.dev/modelserver` or `tokenkeep.dev/sessionserver`: finds the owner of
        a child (and of the pods its controllers create) without reading owner chains."""
        return f"{GROUP}/{self.kind.lower()}"


def labels(owner: Owner, app: str, component: str) -> dict[str, str]:
    return selector_labels(owner, app, component) | {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": "tokenkeep",
        owner.label_key: owner.name,
    }


def selector_labels(owner: Owner, app: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
    }


def selector_string(selector: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(selector.items()))


def metadata(
    owner: Owner,
    name: str,
    object_labels: dict[str, str],
    *,
    owned: bool = True,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace, "labels": object_labels}
    if annotations:
        meta["annotations"] = annotations
    if owned:
        meta["ownerReferences"] = [owner.reference()]
    return meta


def locked_down() -> dict[str, Any]:
    """The security context of every container the operator writes to a read-only root:
    no privilege escalation, no capabilities."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def generated_secret(
    owner: Owner, name: str, key: str, value: str, app: str, component: str
) -> dict[str, Any]:
    """A Secret holding one generated credential (`value`). Created once and never updated:
    the reconciler creates it only where it is missing, so rotating it is deleting it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, name, labels(owner, app, component)),
        "type": "Opaque",
        "stringData": {key: value},
    }


def secret_env(name: str, secret_name: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}}


def scheduling_fields(scheduling: Any) -> dict[str, Any]:
    """Pod spec fields of a `Scheduling`, leaving out the empty ones."""
    fields: dict[str, Any] = {}
    if scheduling.node_selector:
        fields["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        fields["tolerations"] = list(scheduling.tolerations)
    if scheduling.affinity:
        fields["affinity"] = dict(scheduling.affinity)
    if scheduling.priority_class_name:
        fields["priorityClassName"] = scheduling.priority_class_name
    return fields


def http_probe(path: str, *, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def pod_disruption_budget(owner: Owner, name: str, app: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, name, labels(owner, app, component)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner, app, component)},
        },
    }


def service_account(owner: Owner, name: str, app: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(owner, name, labels(owner, app, component)),
        "automountServiceAccountToken": False,
    }


def network_policy(
    owner: Owner, name: str, app: str, component: str, port: int, peers: list[dict[str, str]]
) -> dict[str, Any]:
    """Ingress to the (app, component) pods of `owner` on `port` only, and only from pods of
    this namespace (a podSelector without a namespaceSelector) carrying one of the `peers`
    label sets. Egress is left alone. Kubelet probes still pass: NetworkPolicy cannot block
    a pod's own node, where they come from."""
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, name, labels(owner, app, component)),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner, app, component)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": dict(peer)}} for peer in peers],
                    "ports": [{"port": port, "protocol": "TCP"}],
                }
            ],
        },
    }
