"""The ModelServer and SessionServer custom resources, as Pydantic models.

The CRD schemas in `crds/` are generated from these models (see `crdgen`), and the operator
parses every spec through them, so the schema the API server enforces and the one the operator
assumes cannot drift apart. A rule the OpenAPI schema cannot express is written twice, side by
side: as CEL for the API server (`x-kubernetes-validations`) and as a Pydantic validator for the
operator, which must not trust that every API server enforces CEL.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "tokenkeep.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# vLLM release whose OpenAI server has `--enable-scale-out` (token-in `/inference/v1/generate`)
# and `--shutdown-timeout`; the same version the session server is tested against.
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
# SGLang release whose server arguments and HTTP routes the operator renders and the session
# server's SGLang client honours (read from its wheel: server_args.py, http_server.py); the
# release tag of its CUDA 13 image (the last CUDA 12 tag is v0.5.19-cu129).
DEFAULT_SGLANG_IMAGE = "lmsysorg/sglang:v0.5.23"
DEFAULT_REDIS_IMAGE = "redis:7.4-alpine"
# Children append suffixes such as `-engine-pods` (10 characters) to the resource name and
# Service names are DNS labels (63 characters at most).
MAX_NAME_LENGTH = 48

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN)]
MODEL_URI_PATTERN = "^((hf|pvc)://[^/ ]+(/[^ ]*)?|file:///[^ ]+)$"


def cel(rule: str, message: str) -> dict[str, Any]:
    """A CRD validation rule, attached to a model or field schema."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class CRDModel(BaseModel):
    """camelCase on the wire (as Kubernetes users expect), snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class SecretKeyRef(CRDModel):
    """One key of a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    key: str = Field(min_length=1, max_length=253, description="Key within the Secret.")


class LocalObjectRef(CRDModel):
    name: str = Field(min_length=1, max_length=253, description="Name of the ModelServer.")


class EnvVar(CRDModel):
    name: str = Field(
        min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="Variable name."
    )
    value: str = Field("", description="Variable value.")


class ResourceRequirements(CRDModel):
    """Requests and limits of a container, as in a Pod spec."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Resources reserved for the container (cpu, memory)."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Most the container may use (cpu, memory)."
    )


class Scheduling(CRDModel):
    """Where the pods may run; passed through to the pod spec unchanged."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods require (pod nodeSelector)."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Pod tolerations, e.g. for tainted GPU nodes."
    )
    affinity: dict[str, Any] | None = Field(None, description="Pod affinity, as in a Pod spec.")
    priority_class_name: str | None = Field(None, description="PriorityClass of the pods.")


class NetworkPolicy(CRDModel):
    """Whether the operator renders NetworkPolicies that admit only the intended peers to
    the pods it runs (they take effect only where the cluster's network plugin enforces
    NetworkPolicy)."""

    enabled: bool = Field(
        True,
        description="Render the NetworkPolicies; false deletes the ones rendered before.",
    )


# --- ModelServer -------------------------------------------------------------------------


class ModelSource(CRDModel):
    uri: str = Field(
        max_length=512,
        description=(
            "hf://ORG/NAME for a Hugging Face repository (downloaded into the cache PVC), "
            "pvc://CLAIM/PATH for weights already on a PersistentVolumeClaim, or "
            "file:///PATH for a model directory inside the engine image (built into it, no "
            "hub involved; the session servers copy its tokenizer from that image)."
        ),
        json_schema_extra=cel(
            f"self.matches('{MODEL_URI_PATTERN}')",
            "uri must be hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH",
        ),
    )
    revision: str | None = Field(None, description="Hugging Face revision (branch, tag, commit).")
    served_name: str | None = Field(
        None, description="Model name the API serves; defaults to ORG/NAME or the resource name."
    )
    auth_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding a Hugging Face token (exported as HF_TOKEN)."
    )

    @property
    def scheme(self) -> Literal["hf", "pvc", "file"]:
        scheme = self.uri.split("://", 1)[0]
        return "hf" if scheme == "hf" else "file" if scheme == "file" else "pvc"

    @property
    def location(self) -> str:
        """What follows the scheme: ORG/NAME, CLAIM/PATH, or /PATH."""
        return self.uri.split("://", 1)[1]

    @model_validator(mode="after")
    def _check_uri(self) -> ModelSource:
        if not re.match(MODEL_URI_PATTERN, self.uri):
            raise ValueError("uri: must be hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH")
        return self


class ModelCache(CRDModel):
    """The PersistentVolumeClaim `<name>-model-cache` that holds downloads and compile caches."""

    enabled: bool = Field(
        True, description="A PVC at /cache (HF_HOME, VLLM_CACHE_ROOT); false: an emptyDir."
    )
    size: Quantity = Field("100Gi", description="Requested size of the cache PVC.")
    storage_class_name: str | None = Field(
        None, description="StorageClass of the cache PVC; the cluster default if unset."
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"] = Field(
        "ReadWriteOnce",
        description=(
            "ReadWriteMany lets replicas on different nodes share one cache; with ReadWriteOnce "
            "every replica must be scheduled on the node that holds the volume. A multi-node "
            "engine (parallelism.nodes > 1) gets one claim per pod (cache-<pod>) instead."
        ),
    )
    retain: bool = Field(False, description="Keep the PVC when the ModelServer is deleted.")


class Engine(CRDModel):
    """The engine server each replica runs: `vllm serve MODEL ...` (kind vllm) or
    `python3 -m sglang.launch_server --model-path MODEL ...` (kind sglang)."""

    kind: Literal["vllm", "sglang"] = Field(
        "vllm",
        description="Which engine serves the model: vllm, or sglang (SGLang 0.5.23's server; "
        "one node, GPUs only). The session servers of this ModelServer speak its wire format "
        "(TOKENKEEP_ENGINE_KIND).",
    )
    image: str | None = Field(
        None,
        description=f"Engine image. Unset: {DEFAULT_VLLM_IMAGE} (vllm) or "
        f"{DEFAULT_SGLANG_IMAGE} (sglang).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of the engine container."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Deprecated: use parallelism.tensor, which wins when set. Read as "
        "parallelism.tensor when that is unset.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="--max-model-len; the model's own if unset."
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="GPU memory fraction, in (0, 1]: vLLM's --gpu-memory-utilization (unset: "
        "0.9), SGLang's --mem-fraction-static (unset: SGLang's own choice for the GPU).",
    )
    tool_call_parser: str | None = Field(
        None,
        description="--tool-call-parser, by the engine's own parser names (vLLM: also turns "
        "on --enable-auto-tool-choice).",
    )
    reasoning_parser: str | None = Field(
        None, description="--reasoning-parser, by the engine's own parser names."
    )
    return_routed_experts: bool = Field(
        False,
        description=(
            "MoE routing replay: the engine returns the experts each token was routed to "
            "(--enable-return-routed-experts); sessions that ask for them store them."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Appended to the engine's command line."
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Extra environment of the engine container."
    )

    @property
    def image_or_default(self) -> str:
        """The image the engine pods run: the one named, else the kind's pinned release."""
        return self.image or (DEFAULT_SGLANG_IMAGE if self.kind == "sglang" else DEFAULT_VLLM_IMAGE)


class GPUResources(CRDModel):
    """What each replica gets: GPUs (requests = limits), CPU, memory, shared memory."""

    gpus: int = Field(
        1,
        ge=0,
        le=64,
        description="GPUs per replica. 0: a CPU engine (an image of vLLM's CPU build): no GPU "
        "is requested and no --gpu-memory-utilization passed; size its KV cache with the "
        "VLLM_CPU_KVCACHE_SPACE variable (GiB) in engine.env.",
    )
    gpu_resource_name: str = Field(
        "nvidia.com/gpu", description="Extended resource name the GPUs are requested as."
    )
    cpu: Quantity | None = Field(None, description="CPU request per replica.")
    memory: Quantity | None = Field(None, description="Memory request (and limit) per replica.")
    shared_memory: Quantity = Field(
        "8Gi", description="Size of /dev/shm (NCCL needs it with tensor parallelism)."
    )


class CheckpointVolume(CRDModel):
    """A PersistentVolumeClaim holding policy checkpoints (a trainer writes them), mounted
    read-only at the same path in the engine pods and in the pods of every SessionServer of
    this ModelServer: `POST /policy {"source": {"path": "<mountPath>/<step>"}}` names a folder
    that both read (the session server validates it before any engine reloads it)."""

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        description="The claim, in this namespace. Pods on several nodes need ReadWriteMany "
        "or ReadOnlyMany; the files must be readable by uid 10001 (the session server).",
    )
    mount_path: str = Field(
        "/checkpoints",
        max_length=512,
        pattern=r"^/[^:]*$",
        description="Where it is mounted, read-only, in the engine and session-server pods.",
    )


class Policy(CRDModel):
    """Policy publishing (the session server's POST /policy): on vLLM its development
    endpoints (VLLM_SERVER_DEV_MODE=1), tokenkeep's exact in-place reload and an engine key
    that every request but /health needs (vLLM's --api-key leaves those endpoints open); on
    SGLang its own weight-update endpoints behind --api-key (the same engine key)."""

    publishing: bool = Field(
        True,
        description="Start the engines ready to publish to. false: plain `vllm serve`, no "
        "development endpoints, no engine key (SGLang serves its weight-update endpoints "
        "always: without a key they are open to whatever the NetworkPolicy admits).",
    )
    engine_key_secret_ref: SecretKeyRef | None = Field(
        None,
        description="Secret key holding the engine key (TOKENKEEP_ENGINE_KEY of the engines "
        "and of the session servers). Default: a generated Secret <name>-engine-key, key "
        "engine-key.",
    )
    checkpoints: CheckpointVolume | None = Field(None, description=CheckpointVolume.__doc__)


class Parallelism(CRDModel):
    """How the engine spreads the model over GPUs, as vLLM's own flags. GPUs per pod =
    tensor x pipeline x data / nodes: every GPU of the pod must be accounted for (gpus
    alone never implies pipeline parallelism)."""

    tensor: int | None = Field(
        None,
        ge=1,
        le=64,
        description="--tensor-parallel-size. Unset: engine.tensorParallelSize (default 1).",
    )
    pipeline: int = Field(1, ge=1, le=64, description="--pipeline-parallel-size.")
    data: int = Field(
        1,
        ge=1,
        le=256,
        description="--data-parallel-size: engine ranks, each with tensor x pipeline GPUs, "
        "behind one API server (vLLM balances requests between them). With expert: true, the "
        "MoE layers are spread over the ranks (DeepSeek-V3-class MoE: data 8, expert true).",
    )
    data_local: int | None = Field(
        None,
        ge=1,
        le=256,
        description="--data-parallel-size-local: data-parallel ranks per node (pod). Only "
        "meaningful with nodes > 1; on one node it must equal data. Unset: data / nodes.",
    )
    expert: bool = Field(
        False, description="--enable-expert-parallel: MoE experts sharded over tensor x data."
    )
    nodes: int = Field(
        1,
        ge=1,
        le=64,
        description="Pods (nodes) per engine replica. Above 1 (vLLM only), each replica is a "
        "LeaderWorkerSet group (leaderworkerset.x-k8s.io/v1, its controller installed "
        "separately) of this many pods: the leader serves the API, the workers run headless. "
        "Either the tensor x pipeline ranks span the nodes (data 1), or every node holds whole "
        "data-parallel ranks (data a multiple of nodes).",
    )


class PodTemplateMetadata(CRDModel):
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra pod labels (the operator's own win)."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra pod annotations (the operator's own win)."
    )


class PodTemplate(CRDModel):
    """Merged into the pod the operator renders, as a strategic merge would: containers,
    initContainers, volumes, imagePullSecrets and env by name, volumeMounts by mountPath,
    ports by containerPort, maps key by key, tolerations appended. Where a field is also
    rendered by the operator with another value, the operator's value stays and a
    PodTemplateConflict Warning Event names the field. Use it for runtimeClassName,
    imagePullSecrets, extra volumes and mounts, securityContext / capabilities, extra
    resources (RDMA), sidecars, annotations and labels."""

    metadata: PodTemplateMetadata = Field(
        PodTemplateMetadata(), description="Labels and annotations added to the pods."
    )
    spec: dict[str, Any] = Field(
        default_factory=dict,
        description="A partial Pod spec (as in a Deployment's template.spec); the main "
        "container is named vllm (ModelServer) or session-server (SessionServer).",
    )

    @model_validator(mode="after")
    def _keyed_items_have_keys(self) -> PodTemplate:
        for field in ("containers", "initContainers", "volumes", "imagePullSecrets"):
            items = self.spec.get(field, [])
            if not isinstance(items, list):
                raise ValueError(f"spec.{field}: must be a list")
            for index, item in enumerate(items):
                if not isinstance(item, dict) or not item.get("name"):
                    raise ValueError(f"spec.{field}[{index}]: needs a name")
        return self


MULTI_NODE_NEEDS_GPUS = (
    "a multi-node engine (parallelism.nodes > 1) needs resources.gpus per pod: vLLM spreads "
    "GPU ranks over the nodes"
)

SGLANG_ONE_NODE = (
    "a multi-node SGLang engine (--nnodes, --node-rank, --dist-init-addr) is not built: set "
    "parallelism.nodes to 1"
)
SGLANG_NO_ROUTES = (
    "the session server cannot read SGLang's routed experts (raw bytes without a shape), so "
    "sessions would store none: set engine.returnRoutedExperts to false or use engine.kind vllm"
)
SGLANG_NEEDS_GPUS = (
    "resources.gpus 0 (a CPU engine) is vLLM's CPU build only; SGLang's CPU backend needs its "
    "own image and is not built: give the engine GPUs or use engine.kind vllm"
)

# CEL rules of ModelServerSpec, beside `_gpus_fit_parallelism` which mirrors them.
_TENSOR = (
    "(has(self.parallelism.tensor) ? self.parallelism.tensor : self.engine.tensorParallelSize)"
)
MODELSERVER_RULES = [
    {
        "rule": f"self.resources.gpus == 0 || self.resources.gpus * self.parallelism.nodes == "
        f"{_TENSOR} * self.parallelism.pipeline * self.parallelism.data",
        "message": "resources.gpus per pod must equal parallelism tensor x pipeline x data "
        "(/ nodes): set parallelism.data (data-parallel ranks), parallelism.tensor or "
        "parallelism.pipeline to account for every GPU, or change resources.gpus",
    },
    {
        "rule": "!has(self.parallelism.dataLocal) || "
        "self.parallelism.dataLocal * self.parallelism.nodes == self.parallelism.data",
        "message": "parallelism.dataLocal x parallelism.nodes must equal parallelism.data "
        "(on one node: leave dataLocal unset)",
    },
    {
        "rule": "self.parallelism.nodes == 1 || self.resources.gpus > 0",
        "message": MULTI_NODE_NEEDS_GPUS,
    },
    {
        "rule": "self.parallelism.nodes == 1 || self.parallelism.data == 1 || "
        "self.parallelism.data % self.parallelism.nodes == 0",
        "message": "parallelism.data must be 1 (tensor x pipeline span the nodes) or a multiple "
        "of parallelism.nodes (whole data-parallel ranks on every node)",
    },
    {
        "rule": "!has(self.parallelism.tensor) || self.engine.tensorParallelSize == 1 || "
        "self.engine.tensorParallelSize == self.parallelism.tensor",
        "message": "engine.tensorParallelSize and parallelism.tensor disagree: remove "
        "engine.tensorParallelSize (parallelism.tensor replaces it)",
    },
    # What an SGLang ModelServer cannot be given; `_sglang_can_honour` mirrors them.
    {
        "rule": "self.engine.kind != 'sglang' || self.parallelism.nodes == 1",
        "message": f"engine.kind sglang: {SGLANG_ONE_NODE}",
    },
    {
        "rule": "self.engine.kind != 'sglang' || self.resources.gpus > 0",
        "message": f"engine.kind sglang: {SGLANG_NEEDS_GPUS}",
    },
    {
        "rule": "self.engine.kind != 'sglang' || !self.engine.returnRoutedExperts",
        "message": f"engine.kind sglang: {SGLANG_NO_ROUTES}",
    },
]


class ModelServerSpec(CRDModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": MODELSERVER_RULES})

    model: ModelSource = Field(description="Which model to serve and where it comes from.")
    cache: ModelCache = Field(ModelCache(), description=ModelCache.__doc__)
    engine: Engine = Field(Engine(), description=Engine.__doc__)
    parallelism: Parallelism = Field(Parallelism(), description=Parallelism.__doc__)
    resources: GPUResources = Field(GPUResources(), description=GPUResources.__doc__)
    replicas: int = Field(1, ge=0, description="Also settable through the scale subresource.")
    startup_timeout_seconds: int = Field(
        1800, ge=60, le=86400, description="How long a replica may take to load the model."
    )
    drain_seconds: int = Field(
        60,
        ge=0,
        le=3600,
        description="How long a stopping replica keeps serving in-flight requests.",
    )
    scheduling: Scheduling = Scheduling()
    network_policy: NetworkPolicy = Field(
        NetworkPolicy(),
        description="A NetworkPolicy admitting to the engine port only the pods of the "
        "SessionServers that use this ModelServer and pods labelled "
        "tokenkeep.dev/trainer=<this ModelServer's name> (a trainer's weight updates).",
    )
    policy: Policy = Field(Policy(), description=Policy.__doc__)

    pod_template: PodTemplate = Field(PodTemplate(), description=PodTemplate.__doc__)

    @property
    def tensor_parallel_size(self) -> int:
        """parallelism.tensor when set, else the older engine.tensorParallelSize."""
        return self.parallelism.tensor or self.engine.tensor_parallel_size

    @model_validator(mode="after")
    def _sglang_can_honour(self) -> ModelServerSpec:
        """Mirrors the sglang rules of MODELSERVER_RULES; runs first, so that an SGLang
        resource is told what SGLang lacks rather than what vLLM would need."""
        if self.engine.kind != "sglang":
            return self
        if self.parallelism.nodes != 1:
            raise ValueError(
                f"parallelism.nodes: {self.parallelism.nodes} with engine.kind sglang: "
                f"{SGLANG_ONE_NODE}"
            )
        if self.resources.gpus == 0:
            raise ValueError(f"resources.gpus: 0 with engine.kind sglang: {SGLANG_NEEDS_GPUS}")
        if self.engine.return_routed_experts:
            raise ValueError(
                f"engine.returnRoutedExperts: true with engine.kind sglang: {SGLANG_NO_ROUTES}"
            )
        return self

    @model_validator(mode="after")
    def _gpus_fit_parallelism(self) -> ModelServerSpec:
        """Mirrors MODELSERVER_RULES; each message names the fields to change."""
        par, gpus = self.parallelism, self.resources.gpus
        tensor = self.tensor_parallel_size
        if par.nodes > 1 and not gpus:
            raise ValueError(f"resources.gpus: {MULTI_NODE_NEEDS_GPUS}")
        if par.nodes > 1 and par.data > 1 and par.data % par.nodes:
            # vLLM 0.32 infers each node's ranks from --node-rank (see manifests/engine.py):
            # a data-parallel rank may not straddle a node boundary, and a rank spanning
            # several nodes would need a master address per rank, not one per group.
            raise ValueError(
                f"parallelism.data: {par.data} data-parallel ranks cannot be spread over "
                f"{par.nodes} nodes; set spec.parallelism.data to 1 (tensor x pipeline span "
                f"the nodes) or a multiple of {par.nodes} (whole ranks on every node)"
            )
        if par.tensor is not None and self.engine.tensor_parallel_size not in (1, par.tensor):
            raise ValueError(
                f"engine.tensorParallelSize: {self.engine.tensor_parallel_size} disagrees "
                f"with spec.parallelism.tensor ({par.tensor}): remove "
                "spec.engine.tensorParallelSize (spec.parallelism.tensor replaces it)"
            )
        if par.data_local is not None and par.data_local * par.nodes != par.data:
            raise ValueError(
                f"parallelism.dataLocal: {par.data_local} x nodes {par.nodes} is not "
                f"spec.parallelism.data ({par.data}); on one node leave dataLocal unset"
            )
        ranks = tensor * par.pipeline * par.data
        if gpus and gpus * par.nodes != ranks:
            raise ValueError(f"resources.gpus: {_gpu_mismatch(gpus, tensor, par)}")
        return self


def _gpu_mismatch(gpus: int, tensor: int, par: Parallelism) -> str:
    """Why `gpus` per pod does not fit the parallelism, and the changes that would fit."""
    ranks = tensor * par.pipeline * par.data
    total = gpus * par.nodes
    said = f"{gpus} GPUs per pod"
    if par.nodes > 1:
        said += f" x {par.nodes} nodes = {total}"
    said += f", but tensor x pipeline x data = {tensor} x {par.pipeline} x {par.data} = {ranks}"
    fixes = []
    rest = tensor * par.pipeline
    if total % rest == 0:
        fixes.append(f"spec.parallelism.data: {total // rest} (data-parallel engine ranks)")
    if total % (par.pipeline * par.data) == 0:
        fixes.append(f"spec.parallelism.tensor: {total // (par.pipeline * par.data)}")
    if total % (tensor * par.data) == 0 and total // (tensor * par.data) > 1:
        alone = par.pipeline == par.data == par.nodes == 1
        before = " (what gpus alone rendered before)" if alone else ""
        fixes.append(f"spec.parallelism.pipeline: {total // (tensor * par.data)}{before}")
    if ranks % par.nodes == 0:
        fixes.append(f"spec.resources.gpus: {ranks // par.nodes}")
    return f"{said}; set {' or '.join(fixes)}"


# --- SessionServer -----------------------------------------------------------------------


class ManagedRedis(CRDModel):
    """A one-replica Redis StatefulSet the operator runs (append-only file on a PVC)."""

    image: str = Field(DEFAULT_REDIS_IMAGE, description="Redis image.")
    storage_size: Quantity = Field(
        "10Gi", description="Size of the Redis PVC (fixed once the StatefulSet exists)."
    )
    storage_class_name: str | None = Field(
        None, description="StorageClass of the Redis PVC; the cluster default if unset."
    )
    retain: bool = Field(False, description="Keep the Redis PVC when the resource is deleted.")
    resources: ResourceRequirements | None = Field(
        None,
        description="Requests and limits of the Redis container. Unset: 256Mi requested and a "
        "2Gi limit, or 1Gi and 8Gi where the ModelServer returns routed experts (about 420 "
        "bytes per token stored).",
    )
    max_memory: Quantity | None = Field(
        None,
        description="Redis maxmemory (noeviction: once full, turns are refused with a "
        "retryable 503 and nothing stored is evicted). Unset: 75% of the container's memory "
        "limit (of the default limit where resources set none), leaving room for the "
        "append-only file's rewrite (a fork) and fragmentation. Must stay below the limit.",
    )
    password_secret_ref: SecretKeyRef | None = Field(
        None,
        description="Secret key holding the Redis password (Redis and the session servers "
        "read it). Default: a generated Secret <name>-redis-password, key password.",
    )


class ExternalRedis(CRDModel):
    """A Redis the operator does not run."""

    url_secret_ref: SecretKeyRef = Field(
        description="Secret key holding the URL, password included: redis://, rediss:// (TLS), "
        "redis+sentinel://host:port,host:port/<master name> (Sentinel), or "
        "redis+cluster://host:port,host:port (Cluster); see the session server's docs."
    )
    wait_replicas: int = Field(
        0,
        ge=0,
        description="Acknowledge a turn only once this many Redis replicas hold it (WAIT): no "
        "acknowledged turn lost on failover, at a replication round trip per turn, and turns "
        "refused (503) while fewer replicas are up. Standalone and Sentinel only.",
    )


class Redis(CRDModel):
    """Where sessions are stored."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "self.mode != 'External' || has(self.external)",
            "redis.external.urlSecretRef is required when redis.mode is External",
        )
    )

    mode: Literal["Managed", "External"] = Field(
        "Managed", description="Managed: the operator runs Redis; External: spec.redis.external."
    )
    managed: ManagedRedis = Field(ManagedRedis(), description=ManagedRedis.__doc__)
    external: ExternalRedis | None = Field(None, description=ExternalRedis.__doc__)

    @model_validator(mode="after")
    def _external_has_url(self) -> Redis:
        if self.mode == "External" and self.external is None:
            raise ValueError("external.urlSecretRef: required when spec.redis.mode is External")
        return self


class SessionServerSpec(CRDModel):
    model_server_ref: LocalObjectRef = Field(description="The ModelServer in this namespace.")
    replicas: int = Field(1, ge=0, description="Session server replicas.")
    image: str | None = Field(None, description="Defaults to the operator's own image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of the session server."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer path or Hugging Face id; defaults to the model of an hf:// uri, "
        "and to the model directory's own tokenizer for a file:/// uri (copied from the engine "
        "image at pod start).",
    )
    renderer: str = Field("auto", description="Chat renderer (TOKENKEEP_RENDERER).")
    redis: Redis = Field(Redis(), description=Redis.__doc__)
    session_ttl_seconds: int = Field(
        86400, ge=60, description="Idle sessions expire after this long."
    )
    sampling_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Sampling parameters that win over what harnesses send (e.g. temperature).",
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        None,
        description=(
            "Secret key holding the admin key (management, export, POST /sessions). "
            "Default: a generated Secret <name>-admin-key, key admin-key."
        ),
    )
    resources: ResourceRequirements = Field(
        ResourceRequirements(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "4Gi"}),
        description="Requests and limits of the session server container.",
    )
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="Type of the `<name>-sessions` Service."
    )
    scheduling: Scheduling = Scheduling()
    shutdown_grace_seconds: int = Field(
        30,
        ge=1,
        description="On termination, how long in-flight requests and streams may take to "
        "finish (the pod's terminationGracePeriodSeconds is set to cover it).",
    )
    max_policy_lag: int | None = Field(
        None,
        ge=0,
        description="Refuse a new turn (409) once the engine's policy version exceeds the "
        "version that sampled the rollout's first turn by more than this "
        "(TOKENKEEP_MAX_POLICY_LAG; numeric versions). Unset: no bound.",
    )
    network_policy: NetworkPolicy = Field(
        NetworkPolicy(),
        description="A NetworkPolicy admitting to the managed Redis only this SessionServer's "
        "pods. The session server's own pods get none: harnesses reach them from anywhere.",
    )
    pod_template: PodTemplate = Field(
        PodTemplate(),
        description=PodTemplate.__doc__ + " Applies to the session-server pods, not Redis.",
    )


# --- status ------------------------------------------------------------------------------


class Condition(CRDModel):
    type: str = Field(description="Ready, Progressing or Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase cause (see the operator README).")
    message: str = Field("", description="What happened, for people.")
    last_transition_time: str | None = Field(None, description="When status last changed.")
    observed_generation: int | None = Field(
        None, description="The resource generation this condition describes."
    )


class ModelServerStatus(CRDModel):
    observed_generation: int | None = Field(
        None, description="The generation the operator last acted on."
    )
    replicas: int = Field(0, description="Pods the Deployment made.")
    ready_replicas: int = Field(0, description="Pods passing readiness.")
    available_replicas: int = Field(0, description="Pods ready for minReadySeconds.")
    selector: str | None = Field(None, description="Label selector of the pods (for autoscalers).")
    url: str | None = Field(None, description="OpenAI-compatible base URL of the engine Service.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing and Degraded."
    )


class PolicyStatus(CRDModel):
    """The published policy, as the session server's GET /policy reports it."""

    summary: str = Field(
        description="`VERSION (SERVING/ENGINES)`, `base (...)` before any publish, `unknown` "
        "while the session server cannot be asked, `unsupported` for an image without "
        "GET /policy."
    )
    version: str | None = Field(None, description="The published policy version.")
    published_at: str | None = Field(None, description="When it was published.")
    engine_replicas: int | None = Field(None, description="Engine replicas the server knows.")
    serving_replicas: int | None = Field(
        None, description="Engine replicas serving turns with the published policy."
    )
    message: str | None = Field(
        None, description="Why the policy is unknown, or which replicas do not serve it."
    )


class SessionServerStatus(CRDModel):
    observed_generation: int | None = Field(
        None, description="The generation the operator last acted on."
    )
    replicas: int = Field(0, description="Pods the Deployment made.")
    ready_replicas: int = Field(0, description="Pods passing readiness.")
    available_replicas: int = Field(0, description="Pods ready for minReadySeconds.")
    url: str | None = Field(None, description="Base URL of the session server Service.")
    session_url_template: str | None = Field(
        None, description="OpenAI base URL of one session: replace {session_id}."
    )
    policy: PolicyStatus | None = Field(None, description=PolicyStatus.__doc__)
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing and Degraded."
    )
