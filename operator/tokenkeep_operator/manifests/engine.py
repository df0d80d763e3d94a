"""Children of a ModelServer: the engine Deployment (vLLM, or SGLang with `engine.kind:
sglang`), or for a multi-node vLLM engine the LeaderWorkerSet, and what it needs.

Every function is pure: (owner, spec) in, Kubernetes objects out.

Multi-node engines (`parallelism.nodes > 1`, vLLM only): one LeaderWorkerSet group per
replica, the leader (worker index 0) running `vllm serve` with the API and the workers `vllm
serve --headless`. The launch is vLLM 0.32's own multiprocessing one (no Ray): every pod gets
`--nnodes`, `--node-rank` (the LWS worker index) and `--master-addr` (the leader's address),
as vLLM's ParallelConfig documents for the `mp` executor ("to use mp you must also set
nnodes"). From those vLLM 0.32 (`EngineArgs.create_engine_config`, `vllm serve --headless`)
works out both shapes:
- tensor x pipeline ranks spanning the nodes (data 1): a worker node joins the leader's
  torch.distributed group at --master-addr:--master-port (the headless multiproc executor);
- data-parallel ranks on every node (DP + expert parallel, data a multiple of nodes): each
  node runs `data / nodes` whole ranks (--data-parallel-size-local), its first rank inferred
  as node rank x ranks per node (what --data-parallel-start-rank would say), and the headless
  engines hand-shake with the leader's API server at --data-parallel-address:
  --data-parallel-rpc-port.
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

# The engine pods' app.kubernetes.io/name, whatever the engine: it is part of the Deployment's
# selector, which cannot change, so a ModelServer switched between vllm and sglang keeps it
# (the container's name, vllm or sglang, says which engine a pod runs).
APP = "vllm"
COMPONENT = "engine"
PORT = 8000
CACHE_PATH = "/cache"
MODEL_PATH = "/models"
# Where either engine downloads weights: the cache volume.
HF_HOME_ENV = {"name": "HF_HOME", "value": f"{CACHE_PATH}/huggingface"}
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
# vLLM's own default, rendered explicitly where the ModelServer names none.
VLLM_GPU_MEMORY_UTILIZATION = 0.9

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
# Set by the LeaderWorkerSet controller on every pod of a group ("0": the leader).
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# Injected by the LeaderWorkerSet's pod webhook into every container of a group; the
# kubelet expands $(NAME) in args from the container's environment.
LEADER_ADDRESS_VARIABLE = "LWS_LEADER_ADDRESS"
WORKER_INDEX_VARIABLE = "LWS_WORKER_INDEX"
# vLLM 0.32's defaults (ParallelConfig.master_port, .data_parallel_rpc_port), rendered
# so that every pod of a group agrees on them whatever a later vLLM defaults to.
MASTER_PORT = 29501
DATA_PARALLEL_RPC_PORT = 29550
LEADER, WORKER = "leader", "worker"


def deployment_name(owner_name: str) -> str:
    return f"{owner_name}-engine"


def leader_worker_set_name(owner_name: str) -> str:
    """Not the Deployment's name: the LWS controller makes a headless Service of its own
    name (the pods' subdomain, which LWS_LEADER_ADDRESS resolves through), and the engine's
    ClusterIP Service already has `deployment_name`."""
    return f"{owner_name}-engine-lws"


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
    """Every engine pod of `owner`: a multi-node engine's workers too."""
    return selector_labels(owner, APP, COMPONENT)


def serving_selector(owner: Owner, spec: ModelServerSpec) -> dict[str, str]:
    """The pods that serve the API: the leaders only where a replica is several pods, so
    that the Services (and the session servers' discovery through the headless one) see
    one engine per replica."""
    if spec.parallelism.nodes > 1:
        return {**pod_selector(owner), WORKER_INDEX_LABEL: "0"}
    return pod_selector(owner)


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
    checked that they account for every GPU of the pod); the multi-node flags are
    `multi_node_args`."""
    par = spec.parallelism
    args = ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if par.pipeline > 1:
        args += ["--pipeline-parallel-size", str(par.pipeline)]
    if par.data > 1:
        args += ["--data-parallel-size", str(par.data)]
    if par.expert:
        args.append("--enable-expert-parallel")
    return args


def multi_node_args(spec: ModelServerSpec, role: str) -> list[str]:
    """vLLM 0.32's multi-node launch for one pod of a LeaderWorkerSet group (see the module
    docstring): the same on every pod but the node rank, and --headless on the workers."""
    par = spec.parallelism
    leader = f"$({LEADER_ADDRESS_VARIABLE})"
    rank = "0" if role == LEADER else f"$({WORKER_INDEX_VARIABLE})"
    args = [
        "--nnodes", str(par.nodes),
        "--node-rank", rank,
        "--master-addr", leader,
        "--master-port", str(MASTER_PORT),
    ]  # fmt: skip
    if par.data > 1:
        args += [
            "--data-parallel-size-local", str(par.data // par.nodes),
            "--data-parallel-address", leader,
            "--data-parallel-rpc-port", str(DATA_PARALLEL_RPC_PORT),
        ]  # fmt: skip
    if role == WORKER:
        args.append("--headless")
    return args


def vllm_args(owner_name: str, spec: ModelServerSpec, role: str | None = None) -> list[str]:
    """`vllm serve`'s arguments; `role` (LEADER or WORKER) for a pod of a multi-node group."""
    model, _ = _model_location(spec)
    engine = spec.engine
    args = [
        model,
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--served-model-name", served_model_name(owner_name, spec),
    ]  # fmt: skip
    args += parallel_args(spec)
    if role is not None:
        args += multi_node_args(spec, role)
    if spec.resources.gpus:
        utilization = engine.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
        args += ["--gpu-memory-utilization", str(utilization)]
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


def _resources(spec: ModelServerSpec) -> dict[str, Any]:
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
    return {"requests": requests, "limits": limits}


def _hub_token_env(spec: ModelServerSpec) -> list[dict[str, Any]]:
    ref = spec.model.auth_secret_ref
    return [secret_env("HF_TOKEN", ref.name, ref.key)] if ref else []


def _model_mounts(spec: ModelServerSpec, *engine_mounts: dict[str, Any]) -> list[dict[str, Any]]:
    """The cache, shared memory, a pvc:// model, the engine's own and the checkpoints."""
    mounts = [
        {"name": "cache", "mountPath": CACHE_PATH},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    if spec.model.scheme == "pvc":
        mounts.append({"name": "model", "mountPath": MODEL_PATH, "readOnly": True})
    mounts += engine_mounts
    checkpoints = checkpoint_mount(spec)
    if checkpoints:
        mounts.append(checkpoints[1])
    return mounts


def _serving_fields(spec: ModelServerSpec, role: str | None = None) -> dict[str, Any]:
    """Port, resources, probes, preStop and termination message of either engine's container
    (both answer /health without a key, 503 until the model is loaded). A multi-node group's
    headless WORKER serves no HTTP: no port and no probes, the leader's speak for the group
    (its /health fails when a worker's ranks die, and the group is then recreated)."""
    serving: dict[str, Any] = {}
    if role != WORKER:
        serving = {
            "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
            # Loading weights can take many minutes: the startup probe alone decides how long.
            "startupProbe": http_probe(
                "/health",
                period=STARTUP_PROBE_PERIOD,
                failures=math.ceil(spec.startup_timeout_seconds / STARTUP_PROBE_PERIOD),
            ),
            "readinessProbe": http_probe("/health", period=10, failures=3),
            "livenessProbe": http_probe("/health", period=30, failures=4, timeout=10),
        }
    return {
        **serving,
        "resources": _resources(spec),
        "lifecycle": {
            "preStop": {"exec": {"command": ["sleep", str(ENDPOINT_PROPAGATION_SECONDS)]}}
        },
        # A crash at start (a wrong model path, a bad argument) then shows its last log line
        # in the pod status, which the ModelServer's CrashLoop condition quotes.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _container(owner: Owner, spec: ModelServerSpec, role: str | None) -> dict[str, Any]:
    env = [
        HF_HOME_ENV,
        {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_PATH}/vllm"},
        *_hub_token_env(spec),
    ]
    key = engine_key_ref(owner.name, spec)
    if key:
        env += [
            # vLLM's development endpoints: pause, resume, reload, versions, checksums.
            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
            {"name": "PYTHONPATH", "value": EXTENSION_PATH},
            secret_env(ENGINE_KEY_VARIABLE, key.name, key.key),
        ]
    env += [{"name": var.name, "value": var.value} for var in spec.engine.env]
    extension = {"name": "extension", "mountPath": EXTENSION_PATH, "readOnly": True}
    mounts = _model_mounts(spec, *([extension] if spec.policy.publishing else []))
    return {
        "name": "vllm",
        "image": spec.engine.image_or_default,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": vllm_args(owner.name, spec, role),
        "env": env,
        **_serving_fields(spec, role),
        "volumeMounts": mounts,
    }


def sglang_parallel_args(spec: ModelServerSpec) -> list[str]:
    """SGLang's flags for `spec.parallelism` (0.5.23, server_args' parallel fields), GPUs
    counted as vLLM counts them (tensor x pipeline x data). Without expert, data-parallel ranks
    are SGLang's replicas of the model behind one server (--dp-size). With expert, vLLM's data
    + expert parallel shape is SGLang's attention data parallelism: one tensor-parallel group
    over the tensor x data GPUs, `data` attention groups in it (--attn-dp-size, 0.5.23's
    spelling of the deprecated `--dp-size N --enable-dp-attention`) and the experts sharded
    over all of them (--ep-size, which SGLang requires to equal --tp-size); SGLang refuses
    --dp-size beside --attn-dp-size."""
    par = spec.parallelism
    tensor = spec.tensor_parallel_size
    if par.expert:
        width = tensor * par.data
        args = ["--tp-size", str(width)]
        if par.data > 1:
            args += ["--attn-dp-size", str(par.data)]
        args += ["--ep-size", str(width)]
    else:
        args = ["--tp-size", str(tensor)]
        if par.data > 1:
            args += ["--dp-size", str(par.data)]
    if par.pipeline > 1:
        args += ["--pp-size", str(par.pipeline)]
    return args


def sglang_args(owner_name: str, spec: ModelServerSpec) -> list[str]:
    """`python3 -m sglang.launch_server`'s arguments (SGLang 0.5.23)."""
    model, _ = _model_location(spec)
    engine = spec.engine
    args = [
        "--model-path", model,
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--served-model-name", served_model_name(owner_name, spec),
    ]  # fmt: skip
    args += sglang_parallel_args(spec)
    if engine.gpu_memory_utilization:
        args += ["--mem-fraction-static", str(engine.gpu_memory_utilization)]
    if engine.max_model_len:
        args += ["--context-length", str(engine.max_model_len)]
    if spec.model.revision and spec.model.scheme == "hf":
        args += ["--revision", spec.model.revision]
    # Prometheus metrics at /metrics on the serving port (vLLM serves them unasked). Streamed
    # chunks carry only the new tokens rather than the whole completion so far: the session
    # server reads which mode from /get_server_info and handles both.
    args += ["--enable-metrics", "--incremental-streaming-output"]
    if engine.tool_call_parser:
        args += ["--tool-call-parser", engine.tool_call_parser]
    if engine.reasoning_parser:
        args += ["--reasoning-parser", engine.reasoning_parser]
    if engine_key_ref(owner_name, spec):
        # SGLang reads its key from the command line only; Kubernetes expands the variable,
        # which the Secret fills, so the Deployment holds no key. SGLang then asks for it on
        # every path but /health*, /ready* and /metrics (utils/auth.py), the policy endpoints
        # included: what tokenkeep_vllm.EngineKey does for vLLM.
        args += ["--api-key", f"$({ENGINE_KEY_VARIABLE})"]
    return args + list(engine.extra_args)


def _sglang_container(owner: Owner, spec: ModelServerSpec) -> dict[str, Any]:
    env = [
        HF_HOME_ENV,
        # /health answers from the server's state (503 while starting or unhealthy) rather
        # than by generating a token: a generating check waits for the scheduler, so an
        # engine paused by a policy publish would fail its probes (after 20 s) and be taken
        # out of the Service, or restarted, mid-publish.
        {"name": "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "value": "false"},
        *_hub_token_env(spec),
    ]
    key = engine_key_ref(owner.name, spec)
    if key:
        env.append(secret_env(ENGINE_KEY_VARIABLE, key.name, key.key))
    env += [{"name": var.name, "value": var.value} for var in spec.engine.env]
    return {
        "name": "sglang",
        "image": spec.engine.image_or_default,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": sglang_args(owner.name, spec),
        "env": env,
        **_serving_fields(spec),
        "volumeMounts": _model_mounts(spec),
    }


def _volumes(owner: Owner, spec: ModelServerSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = []
    if not spec.cache.enabled:
        volumes.append({"name": "cache", "emptyDir": {}})
    elif spec.parallelism.nodes == 1:
        claim = {"claimName": cache_claim_name(owner.name)}
        volumes.append({"name": "cache", "persistentVolumeClaim": claim})
    # else: a claim per pod from the LeaderWorkerSet's volumeClaimTemplates.
    shm = {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}
    volumes.append({"name": "shm", "emptyDir": shm})
    _, model_volume = _model_location(spec)
    if model_volume:
        volumes.append(model_volume)
    if _loads_extension(spec):
        volumes.append({"name": "extension", "emptyDir": {"sizeLimit": "1Mi"}})
    checkpoints = checkpoint_mount(spec)
    if checkpoints:
        volumes.append(checkpoints[0])
    return volumes


def _loads_extension(spec: ModelServerSpec) -> bool:
    """A publishing vLLM imports tokenkeep_vllm; SGLang needs nothing of tokenkeep."""
    return spec.policy.publishing and spec.engine.kind == "vllm"


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
    owner: Owner, spec: ModelServerSpec, tokenkeep_image: str, role: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The engine pod template with `spec.podTemplate` merged in, and the fields of
    `spec.podTemplate` the operator's own values overrode (see `podtemplate`). `role`:
    LEADER or WORKER of a multi-node (vLLM) group; the workers get the extension, the engine
    key and the checkpoint mount too, since their ranks load the published weights."""
    pod_extra = (
        {"initContainers": [extension_copy(tokenkeep_image)]} if _loads_extension(spec) else {}
    )
    container = (
        _sglang_container(owner, spec)
        if spec.engine.kind == "sglang"
        else _container(owner, spec, role)
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
            "containers": [container],
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


def leader_worker_set(owner: Owner, spec: ModelServerSpec, tokenkeep_image: str) -> dict[str, Any]:
    """A multi-node engine: one group of `parallelism.nodes` pods per replica. Every field
    is rendered, the LWS webhook's defaults included: an API server without the LWS
    controller (or a later LWS with other defaults) stores exactly this."""
    leader, _ = pod_template(owner, spec, tokenkeep_image, LEADER)
    worker, _ = pod_template(owner, spec, tokenkeep_image, WORKER)
    group: dict[str, Any] = {
        "size": spec.parallelism.nodes,
        # One rank lost is the whole engine lost: vLLM's distributed groups cannot take a
        # restarted member back, so the group starts again together.
        "restartPolicy": "RecreateGroupOnPodRestart",
        "leaderTemplate": leader,
        "workerTemplate": worker,
    }
    if spec.cache.enabled:
        # A cache claim per pod (cache-<pod>): the pods of a group sit on different nodes,
        # and each loads its own copy of the weights. Kept across restarts; deleted with the
        # LeaderWorkerSet unless cache.retain.
        group["volumeClaimTemplates"] = [
            {"metadata": {"name": "cache"}, "spec": _cache_claim_spec(spec)}
        ]
        kept = "Retain" if spec.cache.retain else "Delete"
        group["persistentVolumeClaimRetentionPolicy"] = {
            "whenDeleted": kept,
            "whenScaled": "Retain",
        }
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata(
            owner,
            leader_worker_set_name(owner.name),
            labels(owner, APP, COMPONENT),
            annotations={GENERATION_ANNOTATION: str(owner.generation)},
        ),
        "spec": {
            "replicas": spec.replicas,
            # Workers start with their leader, not once it is ready: the leader's /health
            # answers only after every worker has joined.
            "startupPolicy": "LeaderCreated",
            # Replace one group at a time in place: an update never needs spare GPU nodes.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0, "partition": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": group,
        },
    }


def _service(owner: Owner, spec: ModelServerSpec, name: str, *, headless: bool) -> dict[str, Any]:
    service_spec: dict[str, Any] = {
        "selector": serving_selector(owner, spec),
        "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        service_spec = {"clusterIP": "None", "publishNotReadyAddresses": False, **service_spec}
    else:
        service_spec = {"type": "ClusterIP", **service_spec}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, name, labels(owner, APP, COMPONENT)),
        "spec": service_spec,
    }


def _cache_claim_spec(spec: ModelServerSpec) -> dict[str, Any]:
    claim_spec: dict[str, Any] = {
        "accessModes": [spec.cache.access_mode],
        "resources": {"requests": {"storage": spec.cache.size}},
    }
    if spec.cache.storage_class_name:
        claim_spec["storageClassName"] = spec.cache.storage_class_name
    return claim_spec


def cache_claim(owner: Owner, spec: ModelServerSpec) -> dict[str, Any]:
    claim_spec = _cache_claim_spec(spec)
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


def engine_network_policy(owner: Owner, spec: ModelServerSpec) -> dict[str, Any]:
    """The engines serve unauthenticated (any client may generate, or update weights): only
    the session servers of this ModelServer and its labelled trainers may reach them. The
    pods of a multi-node engine also reach each other on any port (torch.distributed, NCCL's
    TCP bootstrap, vLLM's ZMQ queues and data-parallel handshake pick ports of their own)."""
    peers = [{USES_MODEL_SERVER_LABEL: owner.name}, {TRAINER_LABEL: owner.name}]
    policy = network_policy(owner, deployment_name(owner.name), APP, COMPONENT, PORT, peers)
    if spec.parallelism.nodes > 1:
        group = {"from": [{"podSelector": {"matchLabels": pod_selector(owner)}}]}
        policy["spec"]["ingress"].append(group)
    return policy


def render(owner: Owner, spec: ModelServerSpec, tokenkeep_image: str) -> list[dict[str, Any]]:
    """Every child of a ModelServer, in the order they should be applied (the generated
    engine key Secret is not among them: the reconciler creates it once, see
    `engine_key_secret`). `tokenkeep_image` carries the engine extension."""
    objects = [service_account(owner, deployment_name(owner.name), APP, COMPONENT)]
    if spec.cache.enabled and spec.parallelism.nodes == 1:
        objects.append(cache_claim(owner, spec))
    multi_node = spec.parallelism.nodes > 1
    return [
        *objects,
        _service(owner, spec, deployment_name(owner.name), headless=False),
        _service(owner, spec, pods_service_name(owner.name), headless=True),
        pod_disruption_budget(owner, deployment_name(owner.name), APP, COMPONENT),
        *([engine_network_policy(owner, spec)] if spec.network_policy.enabled else []),
        leader_worker_set(owner, spec, tokenkeep_image)
        if multi_node
        else deployment(owner, spec, tokenkeep_image),
    ]
