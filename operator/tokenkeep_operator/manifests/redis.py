"""The Redis a SessionServer gets when `redis.mode` is Managed: one replica, append-only file
on a PersistentVolumeClaim, so sessions survive a restart."""

from __future__ import annotations

from typing import Any

from tokenkeep_operator.manifests.common import (
    Owner,
    labels,
    metadata,
    network_policy,
    scheduling_fields,
    selector_labels,
)
from tokenkeep_operator.models import ManagedRedis, Scheduling

APP = "redis"
COMPONENT = "session-store"
PORT = 6379
# The uid and gid of the `redis` user in the official images.
REDIS_UID = 999
# Append-only file, synced every second: a restart loses at most a second of turns.
# Protected mode off: without a config file redis-server answers only loopback clients unless
# told otherwise (the official image's entrypoint says so itself, Debian's package does not);
# in a pod the session servers are never loopback, and only they can reach it (ClusterIP-less
# Service, no password: the SessionServer's NetworkPolicy, `network_policy` below, admits its
# own pods alone; without one the namespace's network is the boundary).
SERVER_ARGS = [
    "redis-server",
    "--protected-mode", "no",
    "--appendonly", "yes",
    "--appendfsync", "everysec",
    "--dir", "/data",
]  # fmt: skip


def statefulset_name(owner_name: str) -> str:
    return f"{owner_name}-redis"


def claim_name(owner_name: str) -> str:
    """The claim the StatefulSet makes from its `data` template for its one pod."""
    return f"data-{statefulset_name(owner_name)}-0"


def url(owner_name: str, namespace: str) -> str:
    name = statefulset_name(owner_name)
    return f"redis://{name}-0.{name}.{namespace}.svc:{PORT}/0"


def pod_selector(owner: Owner) -> dict[str, str]:
    return selector_labels(owner, APP, COMPONENT)


def _probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "exec": {"command": ["redis-cli", "ping"]},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def statefulset(owner: Owner, redis: ManagedRedis, scheduling: Scheduling) -> dict[str, Any]:
    name = statefulset_name(owner.name)
    object_labels = labels(owner, APP, COMPONENT)
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": redis.storage_size}},
    }
    if redis.storage_class_name:
        claim_spec["storageClassName"] = redis.storage_class_name
    resources: dict[str, Any] = {}
    if redis.resources.requests:
        resources["requests"] = dict(redis.resources.requests)
    if redis.resources.limits:
        resources["limits"] = dict(redis.resources.limits)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(owner, name, object_labels),
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": {"matchLabels": pod_selector(owner)},
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": "Retain" if redis.retain else "Delete",
                "whenScaled": "Retain",
            },
            "template": {
                "metadata": {"labels": dict(object_labels)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": REDIS_UID,
                        "runAsGroup": REDIS_UID,
                        "fsGroup": REDIS_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "redis",
                            "image": redis.image,
                            "args": list(SERVER_ARGS),
                            "ports": [{"name": "redis", "containerPort": PORT, "protocol": "TCP"}],
                            "readinessProbe": _probe(period=5, failures=3),
                            "livenessProbe": _probe(period=15, failures=4),
                            "resources": resources,
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        }
                    ],
                    **scheduling_fields(scheduling),
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data", "labels": dict(object_labels)},
                    "spec": claim_spec,
                }
            ],
        },
    }


def service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, statefulset_name(owner.name), labels(owner, APP, COMPONENT)),
        "spec": {
            "clusterIP": "None",
            "selector": pod_selector(owner),
            "ports": [{"name": "redis", "port": PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }


def redis_network_policy(owner: Owner, clients: dict[str, str]) -> dict[str, Any]:
    """Redis has no password: only the pods matching `clients` (the session servers of
    this SessionServer) may reach it."""
    return network_policy(owner, statefulset_name(owner.name), APP, COMPONENT, PORT, [clients])


def render(owner: Owner, redis: ManagedRedis, scheduling: Scheduling) -> list[dict[str, Any]]:
    return [service(owner), statefulset(owner, redis, scheduling)]
