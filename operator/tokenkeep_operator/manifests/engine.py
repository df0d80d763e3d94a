"""Children of a ModelServer: the vLLM Deployment and what it needs.

Every function is pure: (owner, spec) in, Kubernetes objects out.
"""

from __future__ import annotations

import math
from typing import Any

from tokenkeep_operator.manifests.common import (
    ENDPOINT_PROPAGATION_SECONDS,
    GENERATION_ANNOTATION,
    TRAINER_LABEL,
    USES_MODEL_SERVER_LABEL,
    Owner,
    http_probe,
    labels,
    metadata,
    network_policy,
    pod_disruption_budget,
    scheduling_fields,
    secret_env,
    selector_labels,
    service_account,
)
from tokenkeep_operator.models import ModelServerSpec

APP = "vllm"
COMPONENT = "engine"
PORT = 8000
CACHE_PATH = "/cache"
MODEL_PATH = "/models"
STARTUP_PROBE_PERIOD = 10
# What vLLM needs after its shutdown timeout to tear down workers and exit.
EXIT_MARGIN_SECONDS = 30


def deployment_name(owner_name: str) -> str:
    return f"{owner_name}-engine"


def pods_service_name(owner_name: str) -> str:
    """The headless Service: one DNS record per ready replica."""
    return f"{owner_name}-engine-pods"


def cache_claim_name(owner_name: str) -> str:
    return f"{owner_name}-model-cache"


def served_model_name(owner_name: str, spec: ModelServerSpec) -> str:
    if spec.model.served_name:
        return spec.model.served_name
    return spec.model.location if spec.model.scheme == "hf" else owner_name


def service_url(owner_name: str, namespace: str) -> str:
    return f"http://{deployment_name(owner_name)}.{namespace}.svc:{PORT}"


def replicas_url(owner_name: str, namespace: str) -> str:
    """The headless Service's URL: resolves to every ready replica, for session affinity."""
    return f"http://{pods_service_name(owner_name)}.{namespace}.svc:{PORT}"


def pod_selector(owner: Owner) -> dict[str, str]:
    return selector_labels(owner, APP, COMPONENT)


def grace_period_seconds(spec: ModelServerSpec) -> int:
    """preStop delay, then vLLM's shutdown timeout for in-flight requests, then exit."""
    return ENDPOINT_PROPAGATION_SECONDS + spec.drain_seconds + EXIT_MARGIN_SECONDS


def _model_location(spec: ModelServerSpec) -> tuple[str, dict[str, Any] | None]:
    """What `vllm serve` loads, and the volume holding it for pvc:// uris."""
    if spec.model.scheme in {"hf", "file"}:
        return spec.model.location, None
    claim, _, path = spec.model.location.partition("/")
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return f"{MODEL_PATH}/{path}".rstrip("/"), volume


def vllm_args(owner_name: str, spec: ModelServerSpec) -> list[str]:
    model, _ = _model_location(spec)
    engine = spec.engine
    args = [
        model,
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--served-model-name", served_model_name(owner_name, spec),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
    ]  # fmt: skip
    if spec.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
    if spec.resources.gpus:
        args += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    if engine.max_model_len:
        args += ["--max-model-len", str(engine.max_model_len)]
    if spec.model.revision and spec.model.scheme == "hf":
        args += ["--revision", spec.model.revision]
    # The session server's token-in endpoint (/inference/v1/generate); prompt token details
    # report the prefix-cache hits tokenkeep records per turn (`cached_tokens`).
    args += ["--enable-scale-out", "--enable-prompt-tokens-details"]
    if engine.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", engine.tool_call_parser]
    if engine.reasoning_parser:
        args += ["--reasoning-parser", engine.reasoning_parser]
    if engine.return_routed_experts:
        args.append("--enable-return-routed-experts")
    args += ["--shutdown-timeout", str(spec.drain_seconds)]
    return args + list(engine.extra_args)


def _container(owner: Owner, spec: ModelServerSpec) -> dict[str, Any]:
    # gpus 0: a CPU engine, scheduled by its cpu and memory requests alone.
    gpus = (
        {spec.resources.gpu_resource_name: str(spec.resources.gpus)} if spec.resources.gpus else {}
    )
    requests = dict(gpus)
    limits = dict(gpus)
    if spec.resources.cpu:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory:
        requests["memory"] = spec.resources.memory
        limits["memory"] = spec.resources.memory
    env = [
        {"name": "HF_HOME", "value": f"{CACHE_PATH}/huggingface"},
        {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_PATH}/vllm"},
    ]
    if spec.model.auth_secret_ref:
        ref = spec.model.auth_secret_ref
        env.append(secret_env("HF_TOKEN", ref.name, ref.key))
    env += [{"name": var.name, "value": var.value} for var in spec.engine.env]
    mounts = [
        {"name": "cache", "mountPath": CACHE_PATH},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    if spec.model.scheme == "pvc":
        mounts.append({"name": "model", "mountPath": MODEL_PATH, "readOnly": True})
    return {
        "name": "vllm",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": vllm_args(owner.name, spec),
        "env": env,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": {"requests": requests, "limits": limits},
        # Loading weights can take many minutes: the startup probe alone decides how long.
        "startupProbe": http_probe(
            "/health",
            period=STARTUP_PROBE_PERIOD,
            failures=math.ceil(spec.startup_timeout_seconds / STARTUP_PROBE_PERIOD),
        ),
        "readinessProbe": http_probe("/health", period=10, failures=3),
        "livenessProbe": http_probe("/health", period=30, failures=4, timeout=10),
        "lifecycle": {
            "preStop": {"exec": {"command": ["sleep", str(ENDPOINT_PROPAGATION_SECONDS)]}}
        },
        "volumeMounts": mounts,
        # A crash at start (a wrong model path, a bad argument) then shows its last log line
        # in the pod status, which the ModelServer's CrashLoop condition quotes.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _volumes(owner: Owner, spec: ModelServerSpec) -> list[dict[str, Any]]:
    if spec.cache.enabled:
        cache: dict[str, Any] = {
            "name": "cache",
            "persistentVolumeClaim": {"claimName": cache_claim_name(owner.name)},
        }
    else:
        cache = {"name": "cache", "emptyDir": {}}
    shm = {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}
    volumes = [cache, {"name": "shm", "emptyDir": shm}]
    _, model_volume = _model_location(spec)
    if model_volume:
        volumes.append(model_volume)
    return volumes


def deployment(owner: Owner, spec: ModelServerSpec) -> dict[str, Any]:
    object_labels = labels(owner, APP, COMPONENT)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(
            owner,
            deployment_name(owner.name),
            object_labels,
            annotations={GENERATION_ANNOTATION: str(owner.generation)},
        ),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": pod_selector(owner)},
            # Replace replicas one at a time in place: an update never needs spare GPUs.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 600,
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": dict(object_labels)},
                "spec": {
                    "serviceAccountName": deployment_name(owner.name),
                    "automountServiceAccountToken": False,
                    # Service links would inject VLLM_PORT-style variables that vLLM reads.
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": grace_period_seconds(spec),
                    "containers": [_container(owner, spec)],
                    "volumes": _volumes(owner, spec),
                    **scheduling_fields(spec.scheduling),
                },
            },
        },
    }


def _service(owner: Owner, name: str, *, headless: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": pod_selector(owner),
        "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        spec = {"clusterIP": "None", "publishNotReadyAddresses": False, **spec}
    else:
        spec = {"type": "ClusterIP", **spec}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, name, labels(owner, APP, COMPONENT)),
        "spec": spec,
    }


def cache_claim(owner: Owner, spec: ModelServerSpec) -> dict[str, Any]:
    claim_spec: dict[str, Any] = {
        "accessModes": [spec.cache.access_mode],
        "resources": {"requests": {"storage": spec.cache.size}},
    }
    if spec.cache.storage_class_name:
        claim_spec["storageClassName"] = spec.cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        # A retained cache has no owner, so garbage collection leaves it behind.
        "metadata": metadata(
            owner,
            cache_claim_name(owner.name),
            labels(owner, APP, COMPONENT),
            owned=not spec.cache.retain,
        ),
        "spec": claim_spec,
    }


def engine_network_policy(owner: Owner) -> dict[str, Any]:
    """The engines serve unauthenticated (any client may generate, or update weights): only
    the session servers of this ModelServer and its labelled trainers may reach them."""
    peers = [{USES_MODEL_SERVER_LABEL: owner.name}, {TRAINER_LABEL: owner.name}]
    return network_policy(owner, deployment_name(owner.name), APP, COMPONENT, PORT, peers)


def render(owner: Owner, spec: ModelServerSpec) -> list[dict[str, Any]]:
    """Every child of a ModelServer, in the order they should be applied."""
    objects = [service_account(owner, deployment_name(owner.name), APP, COMPONENT)]
    if spec.cache.enabled:
        objects.append(cache_claim(owner, spec))
    return [
        *objects,
        _service(owner, deployment_name(owner.name), headless=False),
        _service(owner, pods_service_name(owner.name), headless=True),
        pod_disruption_budget(owner, deployment_name(owner.name), APP, COMPONENT),
        *([engine_network_policy(owner)] if spec.network_policy.enabled else []),
        deployment(owner, spec),
    ]
