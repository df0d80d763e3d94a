"""Children of a ModelServer: the vLLM Deployment and what it needs.

Every function is pure: (owner, spec) in, Kubernetes objects out.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from session_server.devtools.localengine import EXTENSION_MODULE, PUBLISHING_ARGS
from tokenkeep_operator.manifests.common import (
    ENDPOINT_PROPAGATION_SECONDS,
    GENERATION_ANNOTATION,
    TRAINER_LABEL,
    USES_MODEL_SERVER_LABEL,
    Owner,
    generated_secret,
    http_probe,
    labels,
    locked_down,
    metadata,
    network_policy,
    pod_disruption_budget,
    scheduling_fields,
    secret_env,
    selector_labels,
    service_account,
)
from tokenkeep_operator.manifests.podtemplate import merge_pod
from tokenkeep_operator.models import ModelServerSpec, SecretKeyRef

APP = "vllm"
COMPONENT = "engine"
PORT = 8000
CACHE_PATH = "/cache"
MODEL_PATH = "/models"
STARTUP_PROBE_PERIOD = 10
# What vLLM needs after its shutdown timeout to tear down workers and exit.
EXIT_MARGIN_SECONDS = 30
# Policy publishing: where an init container (the tokenkeep image) puts
# session_server/vllm_extension.py as the module `tokenkeep_vllm` for the engine to import
# (any vLLM image, the official one included), and the engine key the module checks.
EXTENSION_PATH = "/opt/tokenkeep-vllm"
ENGINE_KEY_VARIABLE = "TOKENKEEP_ENGINE_KEY"
ENGINE_KEY_SECRET_KEY = "engine-key"
CHECKPOINTS_VOLUME = "checkpoints"


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


def engine_key_ref(owner_name: str, spec: ModelServerSpec) -> SecretKeyRef | None:
    """The engine key of a publishing ModelServer: the Secret the user named, else the one
    the operator generates. None when publishing is off (the engines ask for no key)."""
    if not spec.policy.publishing:
        return None
    return spec.policy.engine_key_secret_ref or SecretKeyRef(
        name=f"{owner_name}-engine-key", key=ENGINE_KEY_SECRET_KEY
    )


def engine_key_secret(owner: Owner) -> dict[str, Any]:
    """A new random engine key. Created once and never updated (the reconciler creates it
    only where it is missing; the operator cannot read Secrets back): rotating it is deleting
    it and restarting the engines and session servers. Owned by the ModelServer."""
    return generated_secret(
        owner,
        f"{owner.name}-engine-key",
        ENGINE_KEY_SECRET_KEY,
        secrets.token_urlsafe(32),
        APP,
        COMPONENT,
    )


def checkpoint_mount(spec: ModelServerSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) of the checkpoint claim, read-only, for the engine pods and the
    session-server pods alike: both must read a published folder at the same path."""
    checkpoints = spec.policy.checkpoints
    if checkpoints is None:
        return None
    volume = {
        "name": CHECKPOINTS_VOLUME,
        "persistentVolumeClaim": {"claimName": checkpoints.claim_name, "readOnly": True},
    }
    mount = {"name": CHECKPOINTS_VOLUME, "mountPath": checkpoints.mount_path, "readOnly": True}
    return volume, mount


def _model_location(spec: ModelServerSpec) -> tuple[str, dict[str, Any] | None]:
    """What `vllm serve` loads, and the volume holding it for pvc:// uris."""
    if spec.model.scheme in {"hf", "file"}:
        return spec.model.location, None
    claim, _, path = spec.model.location.partition("/")
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return f"{MODEL_PATH}/{path}".rstrip("/"), volume


def parallel_args(spec: ModelServerSpec) -> list[str]:
    """vLLM's own parallelism flags, exactly as `spec.parallelism` says (validation has
    checked that they account for every GPU of the pod). One node only: the multi-node
    address and rank flags (--data-parallel-size-local, --data-parallel-address,
    --data-parallel-rpc-port, --data-parallel-start-rank, --headless) belong to the
    LeaderWorkerSet engine, which is not built."""
    par = spec.parallelism
    args = ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if par.pipeline > 1:
        args += ["--pipeline-parallel-size", str(par.pipeline)]
    if par.data > 1:
        args += ["--data-parallel-size", str(par.data)]
    if par.expert:
        args.append("--enable-expert-parallel")
    return args


def vllm_args(owner_name: str, spec: ModelServerSpec) -> list[str]:
    model, _ = _model_location(spec)
    engine = spec.engine
    args = [
        model,
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--served-model-name", served_model_name(owner_name, spec),
    ]  # fmt: skip
    args += parallel_args(spec)
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
    if spec.policy.publishing:
        # The exact in-place reload and the engine key on every path but /health.
        args += list(PUBLISHING_ARGS)
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
    key = engine_key_ref(owner.name, spec)
    if key:
        env += [
            # vLLM's development endpoints: pause, resume, reload, versions, checksums.
            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
            {"name": "PYTHONPATH", "value": EXTENSION_PATH},
            secret_env(ENGINE_KEY_VARIABLE, key.name, key.key),
        ]
    env += [{"name": var.name, "value": var.value} for var in spec.engine.env]
    mounts = [
        {"name": "cache", "mountPath": CACHE_PATH},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    if spec.model.scheme == "pvc":
        mounts.append({"name": "model", "mountPath": MODEL_PATH, "readOnly": True})
    if spec.policy.publishing:
        mounts.append({"name": "extension", "mountPath": EXTENSION_PATH, "readOnly": True})
    checkpoints = checkpoint_mount(spec)
    if checkpoints:
        mounts.append(checkpoints[1])
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
    if spec.policy.publishing:
        volumes.append({"name": "extension", "emptyDir": {"sizeLimit": "1Mi"}})
    checkpoints = checkpoint_mount(spec)
    if checkpoints:
        volumes.append(checkpoints[0])
    return volumes


def extension_copy(tokenkeep_image: str) -> dict[str, Any]:
    """Copies session_server/vllm_extension.py out of the tokenkeep image as `tokenkeep_vllm`
    (the engine's PYTHONPATH): the official vLLM image has no tokenkeep in it, and the module
    then always matches the operator's release."""
    target = f"{EXTENSION_PATH}/{EXTENSION_MODULE}.py"
    script = (
        "import shutil, session_server.vllm_extension as m; "
        f"shutil.copyfile(m.__file__, {target!r})"
    )
    return {
        "name": "tokenkeep-vllm",
        "image": tokenkeep_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-c", script],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        "securityContext": locked_down(),
        "volumeMounts": [{"name": "extension", "mountPath": EXTENSION_PATH}],
    }


def pod_template(
    owner: Owner, spec: ModelServerSpec, tokenkeep_image: str
) -> tuple[dict[str, Any], list[str]]:
    """The engine pod template with `spec.podTemplate` merged in, and the fields of
    `spec.podTemplate` the operator's own values overrode (see `podtemplate`)."""
    pod_extra = (
        {"initContainers": [extension_copy(tokenkeep_image)]} if spec.policy.publishing else {}
    )
    rendered = {
        "metadata": {"labels": dict(labels(owner, APP, COMPONENT))},
        "spec": {
            "serviceAccountName": deployment_name(owner.name),
            "automountServiceAccountToken": False,
            # Service links would inject VLLM_PORT-style variables that vLLM reads.
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": grace_period_seconds(spec),
            **pod_extra,
            "containers": [_container(owner, spec)],
            "volumes": _volumes(owner, spec),
            **scheduling_fields(spec.scheduling),
        },
    }
    return merge_pod(rendered, spec.pod_template)


def deployment(owner: Owner, spec: ModelServerSpec, tokenkeep_image: str) -> dict[str, Any]:
    object_labels = labels(owner, APP, COMPONENT)
    template, _ = pod_template(owner, spec, tokenkeep_image)
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
            "template": template,
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


def render(owner: Owner, spec: ModelServerSpec, tokenkeep_image: str) -> list[dict[str, Any]]:
    """Every child of a ModelServer, in the order they should be applied (the generated
    engine key Secret is not among them: the reconciler creates it once, see
    `engine_key_secret`). `tokenkeep_image` carries the engine extension."""
    objects = [service_account(owner, deployment_name(owner.name), APP, COMPONENT)]
    if spec.cache.enabled:
        objects.append(cache_claim(owner, spec))
    return [
        *objects,
        _service(owner, deployment_name(owner.name), headless=False),
        _service(owner, pods_service_name(owner.name), headless=True),
        pod_disruption_budget(owner, deployment_name(owner.name), APP, COMPONENT),
        *([engine_network_policy(owner)] if spec.network_policy.enabled else []),
        deployment(owner, spec, tokenkeep_image),
    ]
