"""The Redis a SessionServer gets when `redis.mode` is Managed: one replica, append-only file
on a PersistentVolumeClaim, so sessions survive a restart; a password from a Secret; and a
`maxmemory` below its container limit with `noeviction`, so a full Redis refuses writes (the
session server answers 503, nothing stored is evicted) instead of being OOM-killed and then
crash-looping while it replays its append-only file."""

from __future__ import annotations

import re
import secrets
from typing import Any

from tokenkeep_operator.manifests.common import (
    Owner,
    generated_secret,
    labels,
    metadata,
    network_policy,
    scheduling_fields,
    secret_env,
    selector_labels,
)
from tokenkeep_operator.models import ManagedRedis, ResourceRequirements, Scheduling, SecretKeyRef

APP = "redis"
COMPONENT = "session-store"
PORT = 6379
# The uid and gid of the `redis` user in the official images.
REDIS_UID = 999
# Append-only file, synced every second: a restart loses at most a second of turns.
# Protected mode off: without a config file redis-server answers only loopback clients unless
# told otherwise (the official image's entrypoint says so itself, Debian's package does not);
# in a pod the session servers are never loopback. They authenticate with the password
# (`--requirepass`, expanded by the kubelet from the Secret), and the SessionServer's
# NetworkPolicy (`network_policy` below) admits its own pods alone.
SERVER_ARGS = [
    "redis-server",
    "--protected-mode", "no",
    "--appendonly", "yes",
    "--appendfsync", "everysec",
    "--dir", "/data",
    "--requirepass", "$(REDIS_PASSWORD)",
    "--maxmemory-policy", "noeviction",
]  # fmt: skip
PASSWORD_ENV = "REDIS_PASSWORD"
PASSWORD_SECRET_KEY = "password"
# redis-cli reads its password from REDISCLI_AUTH (kept off the probe's command line). It
# exits 0 on a NOAUTH or LOADING error reply too, so the probes check the reply themselves:
# ready on PONG only; alive on PONG or LOADING, so a long append-only-file replay after a
# restart is not killed halfway (and replayed again from the start, forever).
READINESS_COMMAND = ["sh", "-c", "redis-cli ping | grep -qx PONG"]
LIVENESS_COMMAND = ["sh", "-c", "redis-cli ping | grep -qE '^(PONG|LOADING)'"]
MAX_MEMORY_SHARE = 0.75
"""maxmemory as a share of the memory limit: the rest covers the append-only file's rewrite
(a fork whose copied pages count against the pod), fragmentation and client buffers."""
DEFAULT_RESOURCES = ResourceRequirements(
    requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "2Gi"}
)
ROUTED_EXPERTS_RESOURCES = ResourceRequirements(
    requests={"cpu": "100m", "memory": "1Gi"}, limits={"memory": "8Gi"}
)
"""With routed experts (about 420 bytes per token): 6Gi of maxmemory holds about 15M tokens,
some 470 rollouts of 32k tokens, where 2Gi was OOM-killed after about 150."""

_SUFFIXES = {
    "": 1, "m": 10**-3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")


class RedisConfigError(ValueError):
    """The managed Redis's memory settings cannot work (the message says what to change)."""


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("2Gi", "512M", "1e9" is not accepted) in bytes."""
    match = _QUANTITY.match(quantity.strip())
    if match is None or match.group(2) not in _SUFFIXES:
        raise RedisConfigError(f"{quantity!r} is not a memory quantity (e.g. 2Gi, 512Mi)")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2)])


def resources(redis: ManagedRedis, routed_experts: bool) -> ResourceRequirements:
    """The container's resources: the spec's, else the default for what the ModelServer
    stores (routed experts take about 420 bytes per token)."""
    if redis.resources is not None:
        return redis.resources
    return ROUTED_EXPERTS_RESOURCES if routed_experts else DEFAULT_RESOURCES


def max_memory_bytes(redis: ManagedRedis, routed_experts: bool) -> int:
    """Redis's maxmemory: the spec's, else a share of the container's memory limit (of the
    default limit for what the ModelServer stores where the spec's resources set none).
    Raises RedisConfigError when the explicit one does not fit below the limit."""
    limit = resources(redis, routed_experts).limits.get("memory")
    if redis.max_memory is not None:
        wanted = quantity_bytes(redis.max_memory)
        if limit is not None and wanted >= quantity_bytes(limit):
            raise RedisConfigError(
                f"redis.managed.maxMemory {redis.max_memory} must be below the container's "
                f"memory limit {limit} (about {MAX_MEMORY_SHARE:.0%} of it leaves room for "
                "the append-only file's rewrite)"
            )
        return wanted
    if limit is None:
        default = ROUTED_EXPERTS_RESOURCES if routed_experts else DEFAULT_RESOURCES
        limit = default.limits["memory"]
    return int(quantity_bytes(limit) * MAX_MEMORY_SHARE)


def password_ref(owner_name: str, redis: ManagedRedis) -> SecretKeyRef:
    """The Redis password: the Secret the user named, else the one the operator generates."""
    return redis.password_secret_ref or SecretKeyRef(
        name=f"{statefulset_name(owner_name)}-password", key=PASSWORD_SECRET_KEY
    )


def password_secret(owner: Owner) -> dict[str, Any]:
    """A new random Redis password. Created once and never updated (the reconciler creates
    it only where it is missing): rotating it is deleting it, then restarting Redis and the
    session servers. Hex: safe in a URL and on a command line."""
    return generated_secret(
        owner,
        f"{statefulset_name(owner.name)}-password",
        PASSWORD_SECRET_KEY,
        secrets.token_hex(32),
        APP,
        COMPONENT,
    )


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


def _probe(command: list[str], period: int, failures: int) -> dict[str, Any]:
    return {
        "exec": {"command": list(command)},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def statefulset(
    owner: Owner, redis: ManagedRedis, scheduling: Scheduling, routed_experts: bool = False
) -> dict[str, Any]:
    name = statefulset_name(owner.name)
    object_labels = labels(owner, APP, COMPONENT)
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": redis.storage_size}},
    }
    if redis.storage_class_name:
        claim_spec["storageClassName"] = redis.storage_class_name
    wanted = resources(redis, routed_experts)
    container_resources: dict[str, Any] = {}
    if wanted.requests:
        container_resources["requests"] = dict(wanted.requests)
    if wanted.limits:
        container_resources["limits"] = dict(wanted.limits)
    password = password_ref(owner.name, redis)
    args = [*SERVER_ARGS, "--maxmemory", str(max_memory_bytes(redis, routed_experts))]
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
                            "args": args,
                            "env": [
                                secret_env(PASSWORD_ENV, password.name, password.key),
                                secret_env("REDISCLI_AUTH", password.name, password.key),
                            ],
                            "ports": [{"name": "redis", "containerPort": PORT, "protocol": "TCP"}],
                            "readinessProbe": _probe(READINESS_COMMAND, period=5, failures=3),
                            "livenessProbe": _probe(LIVENESS_COMMAND, period=15, failures=4),
                            "resources": container_resources,
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
    """Only the pods matching `clients` (the session servers of this SessionServer) may reach
    Redis (beside its password)."""
    return network_policy(owner, statefulset_name(owner.name), APP, COMPONENT, PORT, [clients])


def render(
    owner: Owner, redis: ManagedRedis, scheduling: Scheduling, routed_experts: bool = False
) -> list[dict[str, Any]]:
    return [service(owner), statefulset(owner, redis, scheduling, routed_experts)]
