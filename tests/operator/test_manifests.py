"""Rendered children: golden files, Kubernetes schema validity, and the properties users
rely on (token endpoints on, GPUs consistent, slow loads survive, drains finish)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from session_server.settings import ENV_PREFIX, READ_VARIABLES
from tests.operator.conftest import TEST_NAMESPACE, load_example, owner_of
from tests.operator.schemas import custom_resource_errors, validate_builtin
from tokenkeep_operator.manifests import engine, redis, session
from tokenkeep_operator.models import ModelServerSpec, SessionServerSpec

GOLDEN = Path(__file__).parent / "golden"
# The pinned upstream CRD (tests/operator/crds/README.md).
LWS_CRD = Path(__file__).parent / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"


@cache
def lws_crd() -> dict[str, Any]:
    """The pinned LeaderWorkerSet CRD, parsed once (1.3 MB, with libyaml where present)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(LWS_CRD.read_text(), Loader=loader)


IMAGE = "registry.example/tokenkeep:0.1.0"


def render_modelserver(resource: dict[str, Any]) -> list[dict[str, Any]]:
    spec = ModelServerSpec.model_validate(resource["spec"])
    return engine.render(owner_of(resource), spec, IMAGE)


def render_sessionserver(
    resource: dict[str, Any], model_server: dict[str, Any]
) -> list[dict[str, Any]]:
    return session.render(
        owner_of(resource),
        SessionServerSpec.model_validate(resource["spec"]),
        model_server["metadata"]["name"],
        ModelServerSpec.model_validate(model_server["spec"]),
        IMAGE,
    )


def pvc_modelserver() -> dict[str, Any]:
    return {
        "apiVersion": "tokenkeep.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "local"},
        "spec": {
            "model": {"uri": "pvc://weights/qwen3/8b", "servedName": "qwen3-8b"},
            "cache": {"enabled": False},
            "resources": {"gpus": 2},
            "parallelism": {"pipeline": 2},
            "engine": {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]},
            "scheduling": {"nodeSelector": {"gpu": "h100"}, "priorityClassName": "rl"},
            "policy": {
                "engineKeySecretRef": {"name": "trainer-keys", "key": "engine"},
                "checkpoints": {"claimName": "rl-checkpoints", "mountPath": "/ckpt"},
            },
        },
    }


def external_sessionserver() -> dict[str, Any]:
    return {
        "apiVersion": "tokenkeep.dev/v1alpha1",
        "kind": "SessionServer",
        "metadata": {"name": "ext"},
        "spec": {
            "modelServerRef": {"name": "local"},
            "tokenizer": "Qwen/Qwen3-8B",
            "redis": {
                "mode": "External",
                "external": {"urlSecretRef": {"name": "r", "key": "url"}},
            },
            "serviceType": "LoadBalancer",
        },
    }


def pod_template_modelserver() -> dict[str, Any]:
    """The 8B example with a pod template of everything a GPU cluster asks for, and two
    fields the operator sets itself (the engine's args and its GPU limit)."""
    resource = load_example("gpu/dense-8b.yaml")
    resource["spec"]["podTemplate"] = {
        "metadata": {
            "labels": {"team": "rl", "app.kubernetes.io/name": "mine"},
            "annotations": {"prometheus.io/scrape": "true"},
        },
        "spec": {
            "runtimeClassName": "nvidia",
            "imagePullSecrets": [{"name": "registry-creds"}],
            "securityContext": {"fsGroup": 1000},
            "tolerations": [{"key": "rdma", "operator": "Exists", "effect": "NoSchedule"}],
            "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "data"}}],
            "containers": [
                {
                    "name": "vllm",
                    "args": ["--model", "other"],
                    "volumeMounts": [{"name": "datasets", "mountPath": "/data"}],
                    "resources": {
                        "requests": {"rdma/ib": "1"},
                        "limits": {"rdma/ib": "1", "nvidia.com/gpu": "2"},
                    },
                    "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                },
                {"name": "sidecar", "image": "busybox:1.36", "command": ["sleep", "inf"]},
            ],
        },
    }
    return resource


def two_node_pipeline_modelserver() -> dict[str, Any]:
    """A dense model over two nodes: tensor 8 within each node, pipeline 2 across them (the
    shape vLLM documents for a model that fits no single node), cache claims per pod."""
    return {
        "apiVersion": "tokenkeep.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "llama-405b"},
        "spec": {
            "model": {"uri": "hf://meta-llama/Llama-3.1-405B-Instruct"},
            "cache": {"size": "1Ti", "retain": True},
            "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2},
            "resources": {"gpus": 8, "sharedMemory": "64Gi"},
            "replicas": 2,
            "policy": {"checkpoints": {"claimName": "rl-checkpoints", "mountPath": "/ckpt"}},
        },
    }


SCENARIOS = {
    "modelserver-qwen3-8b": lambda: render_modelserver(load_example("modelserver-qwen3-8b.yaml")),
    "modelserver-llama-70b-tp4": lambda: render_modelserver(
        load_example("modelserver-llama-70b-tp4.yaml")
    ),
    "modelserver-pvc-no-cache": lambda: render_modelserver(pvc_modelserver()),
    "sessionserver-managed-redis": lambda: render_sessionserver(
        load_example("sessionserver.yaml"), load_example("modelserver-qwen3-8b.yaml")
    ),
    "sessionserver-external-redis": lambda: render_sessionserver(
        external_sessionserver(), pvc_modelserver()
    ),
    "modelserver-cpu": lambda: render_modelserver(load_example("cpu/modelserver.yaml")),
    "sessionserver-cpu": lambda: render_sessionserver(
        load_example("cpu/sessionserver.yaml"), load_example("cpu/modelserver.yaml")
    ),
    "gpu-dense-8b": lambda: render_modelserver(load_example("gpu/dense-8b.yaml")),
    "gpu-dense-70b-tp4": lambda: render_modelserver(load_example("gpu/dense-70b-tp4.yaml")),
    "gpu-moe-dp8-ep": lambda: render_modelserver(load_example("gpu/moe-dp8-ep.yaml")),
    "gpu-sglang-moe-dp8-ep": lambda: render_modelserver(load_example("gpu/sglang-moe-dp8-ep.yaml")),
    "modelserver-pod-template": lambda: render_modelserver(pod_template_modelserver()),
    "gpu-moe-two-nodes": lambda: render_modelserver(load_example("gpu/moe-two-nodes.yaml")),
    "modelserver-two-node-pipeline": lambda: render_modelserver(two_node_pipeline_modelserver()),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rendered_objects_match_golden_files(scenario: str) -> None:
    """Set UPDATE_GOLDEN=1 to rewrite them after an intended change, then review the diff."""
    rendered = yaml.safe_dump_all(SCENARIOS[scenario](), sort_keys=True)
    path = GOLDEN / f"{scenario}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(rendered)
    assert rendered == path.read_text()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rendered_objects_are_valid_kubernetes_objects(scenario: str) -> None:
    """Built-in kinds against Kubernetes' schemas; a LeaderWorkerSet against the pinned LWS
    CRD, and its two pod templates as the built-in PodTemplate they are."""
    for obj in SCENARIOS[scenario]():
        if obj["kind"] != "LeaderWorkerSet":
            validate_builtin(obj)
            continue
        assert custom_resource_errors(lws_crd(), obj) == []
        group = obj["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            template = {"apiVersion": "v1", "kind": "PodTemplate", "template": group[role]}
            validate_builtin({**template, "metadata": {"name": role.lower()}})


def _every_option_sessionserver() -> list[dict[str, Any]]:
    """A SessionServer with each optional setting given (the golden scenarios leave some out),
    in front of a gated model (its HF_TOKEN)."""
    resource = external_sessionserver()
    resource["spec"]["redis"]["external"]["waitReplicas"] = 1
    resource["spec"] |= {"maxPolicyLag": 2, "samplingOverrides": {"temperature": 0.7}}
    model_server = load_example("modelserver-qwen3-8b.yaml")
    model_server["spec"]["model"]["authSecretRef"] = {"name": "hf", "key": "token"}
    return render_sessionserver(resource, model_server)


def _tokenkeep_variables(objects: list[dict[str, Any]]) -> set[str]:
    """The TOKENKEEP_* names these objects give a container: ConfigMap keys and env names."""
    names = set()
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            names |= set(obj["data"])
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            names |= {e["name"] for e in container.get("env", [])}
    return {n for n in names if n.startswith(ENV_PREFIX)}


def test_every_tokenkeep_variable_the_operator_writes_is_a_server_setting() -> None:
    """The server ignores a variable it does not know (and `tokenkeep serve` refuses one):
    a misspelt name here would be a setting silently lost, or a pod that never starts."""
    renderings = [scenario() for scenario in SCENARIOS.values()] + [_every_option_sessionserver()]
    written = set().union(*(_tokenkeep_variables(objects) for objects in renderings))
    assert written - READ_VARIABLES == set()
    # Every optional setting was rendered at least once, so the check above saw it.
    assert {
        "TOKENKEEP_MAX_POLICY_LAG",
        "TOKENKEEP_REDIS_WAIT_REPLICAS",
        "TOKENKEEP_SAMPLING_OVERRIDES",
        "TOKENKEEP_ADMIN_KEY",
        "TOKENKEEP_ENGINE_KEY",
    } <= written


def _by_kind(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_vllm_runs_with_token_endpoints_parsers_and_consistent_gpus() -> None:
    objects = _by_kind(render_modelserver(load_example("modelserver-llama-70b-tp4.yaml")))
    pod = objects[("Deployment", "llama-70b-engine")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[0] == "meta-llama/Llama-3.3-70B-Instruct"
    assert "--enable-scale-out" in args and "--enable-auto-tool-choice" in args
    assert _flag(args, "--tool-call-parser") == "llama3_json"
    assert _flag(args, "--tensor-parallel-size") == "4"
    assert "--pipeline-parallel-size" not in args
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


def _engine(resource: dict[str, Any]) -> dict[str, Any]:
    """The vLLM container of a rendered ModelServer."""
    deployment = next(o for o in render_modelserver(resource) if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _parallel_flags(args: list[str]) -> dict[str, str | bool]:
    flags: dict[str, str | bool] = {}
    for flag in (
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--data-parallel-size-local",
    ):
        if flag in args:
            flags[flag] = _flag(args, flag)
    if "--enable-expert-parallel" in args:
        flags["--enable-expert-parallel"] = True
    return flags


def test_pipeline_parallel_is_rendered_only_when_asked_for() -> None:
    container = _engine(pvc_modelserver())  # gpus 2, parallelism.pipeline 2
    assert _parallel_flags(container["args"]) == {
        "--tensor-parallel-size": "1",
        "--pipeline-parallel-size": "2",
    }
    assert container["args"][0] == "/models/qwen3/8b"


@pytest.mark.parametrize(
    ("example", "gpus", "flags"),
    [
        ("gpu/dense-8b.yaml", "1", {"--tensor-parallel-size": "1"}),
        ("gpu/dense-70b-tp4.yaml", "4", {"--tensor-parallel-size": "4"}),
        (
            "gpu/moe-dp8-ep.yaml",
            "8",
            {
                "--tensor-parallel-size": "1",
                "--data-parallel-size": "8",
                "--enable-expert-parallel": True,
            },
        ),
    ],
)
def test_gpu_examples_render_their_parallelism_as_vllm_flags(
    example: str, gpus: str, flags: dict[str, Any]
) -> None:
    container = _engine(load_example(example))
    assert _parallel_flags(container["args"]) == flags
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus


def test_gpu_examples_cache_works_on_read_write_once_default_storage() -> None:
    for name in ("dense-8b", "dense-70b-tp4", "moe-dp8-ep"):
        objects = render_modelserver(load_example(f"gpu/{name}.yaml"))
        (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"], name
        assert "storageClassName" not in claim["spec"], name  # the cluster's default class


def test_the_older_tensor_parallel_field_still_works_and_the_new_one_wins() -> None:
    resource = load_example("modelserver-qwen3-8b.yaml")
    resource["spec"]["resources"]["gpus"] = 2
    resource["spec"]["engine"]["tensorParallelSize"] = 2
    assert _parallel_flags(_engine(resource)["args"]) == {"--tensor-parallel-size": "2"}
    # parallelism.tensor wins over the stored default of engine.tensorParallelSize (1).
    resource["spec"]["engine"]["tensorParallelSize"] = 1
    resource["spec"]["parallelism"] = {"tensor": 2}
    assert _parallel_flags(_engine(resource)["args"]) == {"--tensor-parallel-size": "2"}


def test_data_parallel_is_one_flag_and_never_pipeline_stages() -> None:
    """What a user did before (gpus 8 + extraArgs --data-parallel-size 8) rendered 64 ranks
    on 8 GPUs; now gpus 8 without parallelism is refused (see test_crds), and with
    parallelism.data: 8 the flag appears once."""
    resource = load_example("modelserver-qwen3-8b.yaml")
    resource["spec"]["resources"]["gpus"] = 8
    resource["spec"]["parallelism"] = {"data": 8}
    args = _engine(resource)["args"]
    assert args.count("--data-parallel-size") == 1
    assert "--pipeline-parallel-size" not in args


# --- spec.podTemplate -------------------------------------------------------------------


def test_pod_template_adds_what_gpu_clusters_need_to_the_engine_pod() -> None:
    deployment = next(
        o for o in render_modelserver(pod_template_modelserver()) if o["kind"] == "Deployment"
    )
    template = deployment["spec"]["template"]
    pod = template["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["securityContext"] == {"fsGroup": 1000}
    assert {"key": "rdma", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # The example's own toleration stays beside it.
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["datasets"] == {
        "name": "datasets",
        "persistentVolumeClaim": {"claimName": "data"},
    }
    assert {"cache", "shm", "extension"} <= volumes.keys()
    vllm, sidecar = pod["containers"]
    assert vllm["name"] == "vllm" and sidecar["name"] == "sidecar"
    assert {"name": "datasets", "mountPath": "/data"} in vllm["volumeMounts"]
    assert {"name": "cache", "mountPath": "/cache"} in vllm["volumeMounts"]
    assert vllm["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    # Extra resources are added; the operator's GPU count and its vLLM command line win.
    assert vllm["resources"]["limits"] == {"nvidia.com/gpu": "1", "rdma/ib": "1", "memory": "64Gi"}
    assert vllm["resources"]["requests"]["rdma/ib"] == "1"
    assert vllm["args"][0] == "Qwen/Qwen3-8B" and "other" not in vllm["args"]
    labels = template["metadata"]["labels"]
    assert labels["team"] == "rl" and labels["app.kubernetes.io/name"] == "vllm"
    assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    # The Services and the Deployment still select the pods.
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    validate_builtin(deployment)


def test_pod_template_conflicts_name_each_overridden_field() -> None:
    from tokenkeep_operator.manifests import podtemplate

    resource = pod_template_modelserver()
    spec = ModelServerSpec.model_validate(resource["spec"])
    owner = owner_of(resource)
    conflicts = podtemplate.conflicts(lambda s: engine.render(owner, s, IMAGE), spec)
    assert [c.split(": ")[0] for c in conflicts] == [
        "spec.podTemplate.metadata.labels.app.kubernetes.io/name",
        "spec.podTemplate.spec.containers[name=vllm].args",
        "spec.podTemplate.spec.containers[name=vllm].resources.limits.nvidia.com/gpu",
    ]
    assert conflicts[0].endswith(": 'mine' ignored, the operator sets 'vllm'")
    assert (
        conflicts[1]
        .split(": ", 1)[1]
        .startswith("['--model', 'other'] ignored, the operator sets ['Qwen/Qwen3-8B', ")
    )
    assert conflicts[2].endswith(": '2' ignored, the operator sets '1'")
    # Without conflicting fields nothing is reported; without a pod template neither.
    del resource["spec"]["podTemplate"]["spec"]["containers"][0]["args"]
    del resource["spec"]["podTemplate"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"
    ]
    del resource["spec"]["podTemplate"]["metadata"]["labels"]["app.kubernetes.io/name"]
    spec = ModelServerSpec.model_validate(resource["spec"])
    assert podtemplate.conflicts(lambda s: engine.render(owner, s, IMAGE), spec) == []


def test_a_pod_template_volume_named_like_the_operators_keeps_the_operators() -> None:
    resource = load_example("gpu/dense-8b.yaml")
    resource["spec"]["podTemplate"] = {
        "spec": {
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "containers": [{"name": "vllm", "env": [{"name": "HF_HOME", "value": "/elsewhere"}]}],
        }
    }
    pod = _engine_pod(render_modelserver(resource))
    (cache,) = [v for v in pod["volumes"] if v["name"] == "cache"]
    assert cache == {
        "name": "cache",
        "persistentVolumeClaim": {"claimName": "qwen3-8b-model-cache"},
    }
    assert _env(pod["containers"][0])["HF_HOME"] == "/cache/huggingface"


def test_pod_template_reaches_the_session_server_pods_not_redis() -> None:
    resource = load_example("sessionserver.yaml")
    resource["spec"]["podTemplate"] = {
        "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": {
            "imagePullSecrets": [{"name": "registry-creds"}],
            "securityContext": {"runAsUser": 0, "fsGroup": 10001},
            "containers": [{"name": "session-server", "resources": {"limits": {"cpu": "4"}}}],
        },
    }
    objects = render_sessionserver(resource, load_example("modelserver-qwen3-8b.yaml"))
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert "tokenkeep.dev/config-hash" in template["metadata"]["annotations"]
    pod = template["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    # The image's non-root user stays; fsGroup is added.
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["fsGroup"] == 10001
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"memory": "4Gi", "cpu": "4"}
    validate_builtin(deployment)
    redis_pod = next(o for o in objects if o["kind"] == "StatefulSet")["spec"]["template"]
    assert "registry-creds" not in str(redis_pod)


def test_slow_loads_survive_and_drains_finish_within_the_grace_period() -> None:
    resource = load_example("modelserver-llama-70b-tp4.yaml")
    spec = ModelServerSpec.model_validate(resource["spec"])
    deployment = _by_kind(render_modelserver(resource))[("Deployment", "llama-70b-engine")]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= spec.startup_timeout_seconds
    assert startup["httpGet"]["path"] == container["readinessProbe"]["httpGet"]["path"] == "/health"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    shutdown = int(_flag(container["args"], "--shutdown-timeout"))
    assert shutdown == spec.drain_seconds
    assert pod["terminationGracePeriodSeconds"] > pre_stop + shutdown
    # The rollout waits for a replica as long as a replica may take to load.
    assert deployment["spec"]["progressDeadlineSeconds"] > spec.startup_timeout_seconds


def test_rollouts_never_need_spare_gpus() -> None:
    deployment = render_modelserver(load_example("modelserver-qwen3-8b.yaml"))[-1]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_services_select_the_engine_pods_and_one_is_headless() -> None:
    objects = render_modelserver(load_example("modelserver-qwen3-8b.yaml"))
    deployment = objects[-1]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = [o for o in objects if o["kind"] == "Service"]
    assert len(services) == 2
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels.items()
    headless = next(s for s in services if s["spec"].get("clusterIP") == "None")
    assert headless["metadata"]["name"] == engine.pods_service_name("qwen3-8b")


def test_cache_claim_is_owned_unless_retained() -> None:
    resource = load_example("modelserver-qwen3-8b.yaml")
    claim = _by_kind(render_modelserver(resource))[
        ("PersistentVolumeClaim", "qwen3-8b-model-cache")
    ]
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "ModelServer"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    resource["spec"]["cache"]["retain"] = True
    claim = _by_kind(render_modelserver(resource))[
        ("PersistentVolumeClaim", "qwen3-8b-model-cache")
    ]
    assert "ownerReferences" not in claim["metadata"]


def test_every_child_is_owned_and_labelled() -> None:
    objects = render_modelserver(load_example("modelserver-qwen3-8b.yaml")) + render_sessionserver(
        load_example("sessionserver.yaml"), load_example("modelserver-qwen3-8b.yaml")
    )
    for obj in objects:
        assert obj["metadata"]["namespace"] == TEST_NAMESPACE
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tokenkeep-operator"
        assert obj["metadata"]["ownerReferences"][0]["controller"] is True


def _session_env(objects: list[dict[str, Any]]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    data = next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    container = objects[-1]["spec"]["template"]["spec"]["containers"][0]
    return data, container.get("env", [])


def test_session_server_points_at_every_engine_replica_and_its_redis() -> None:
    model_server = load_example("modelserver-qwen3-8b.yaml")
    objects = render_sessionserver(load_example("sessionserver.yaml"), model_server)
    data, env = _session_env(objects)
    assert data["TOKENKEEP_ENGINE_URLS"] == f"http://qwen3-8b-engine-pods.{TEST_NAMESPACE}.svc:8000"
    assert data["TOKENKEEP_MODEL"] == data["TOKENKEEP_TOKENIZER"] == "Qwen/Qwen3-8B"
    assert data["TOKENKEEP_SAMPLING_OVERRIDES"] == '{"temperature":1.0,"top_p":1.0}'
    assert data["TOKENKEEP_SESSION_TTL_SECONDS"] == "21600"
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    name = statefulset["metadata"]["name"]
    assert data["TOKENKEEP_REDIS_URL"] == f"redis://{name}-0.{name}.{TEST_NAMESPACE}.svc:6379/0"
    assert statefulset["spec"]["serviceName"] == name
    assert "--appendonly" in statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert statefulset["spec"]["volumeClaimTemplates"][0]["spec"]["resources"] == {
        "requests": {"storage": "20Gi"}
    }
    api_key = next(e for e in env if e["name"] == "TOKENKEEP_ADMIN_KEY")
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "tokenkeep-api-key", "key": "api-key"}
    container = objects[-1]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_max_policy_lag_reaches_the_session_server_and_engines_report_cache_hits() -> None:
    resource = load_example("sessionserver.yaml")
    model_server = load_example("modelserver-qwen3-8b.yaml")
    data, _ = _session_env(render_sessionserver(resource, model_server))
    assert "TOKENKEEP_MAX_POLICY_LAG" not in data
    resource["spec"]["maxPolicyLag"] = 2
    data, _ = _session_env(render_sessionserver(resource, model_server))
    assert data["TOKENKEEP_MAX_POLICY_LAG"] == "2"
    objects = _by_kind(render_modelserver(model_server))
    engine_args = objects[("Deployment", "qwen3-8b-engine")]["spec"]["template"]["spec"]
    assert "--enable-prompt-tokens-details" in engine_args["containers"][0]["args"]


def test_external_redis_url_comes_from_its_secret_and_no_redis_is_run() -> None:
    objects = render_sessionserver(external_sessionserver(), pvc_modelserver())
    data, env = _session_env(objects)
    assert "TOKENKEEP_REDIS_URL" not in data
    assert {"kind": "StatefulSet"} not in [{"kind": o["kind"]} for o in objects]
    redis_url = next(e for e in env if e["name"] == "TOKENKEEP_REDIS_URL")
    assert redis_url["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "url"}
    assert data["TOKENKEEP_MODEL"] == "qwen3-8b"


def test_changed_settings_roll_the_session_pods() -> None:
    model_server = load_example("modelserver-qwen3-8b.yaml")
    resource = load_example("sessionserver.yaml")

    def config_hash() -> str:
        deployment = render_sessionserver(resource, model_server)[-1]
        return deployment["spec"]["template"]["metadata"]["annotations"][
            "tokenkeep.dev/config-hash"
        ]

    before = config_hash()
    assert config_hash() == before
    resource["spec"]["samplingOverrides"]["temperature"] = 0.7
    assert config_hash() != before


def test_pvc_model_needs_an_explicit_tokenizer() -> None:
    resource = external_sessionserver()
    del resource["spec"]["tokenizer"]
    with pytest.raises(session.ConfigError, match=r"spec\.tokenizer is required"):
        render_sessionserver(resource, pvc_modelserver())


def test_hub_model_revision_pins_the_session_servers_tokenizer() -> None:
    """The engine loads `model.revision` (`--revision`); the session server's tokenizer must be
    that revision's too, not `main`'s."""
    resource = load_example("sessionserver.yaml")
    model_server = load_example("modelserver-qwen3-8b.yaml")
    config = next(
        o for o in render_sessionserver(resource, model_server) if o["kind"] == "ConfigMap"
    )
    assert "TOKENKEEP_TOKENIZER_REVISION" not in config["data"]
    model_server["spec"]["model"]["revision"] = "b968826d9c46dd6066d109eabc6255188de91218"
    config = next(
        o for o in render_sessionserver(resource, model_server) if o["kind"] == "ConfigMap"
    )
    assert config["data"]["TOKENKEEP_TOKENIZER"] == "Qwen/Qwen3-8B"
    assert (
        config["data"]["TOKENKEEP_TOKENIZER_REVISION"] == "b968826d9c46dd6066d109eabc6255188de91218"
    )


def test_redis_pvc_is_deleted_with_the_resource_unless_retained() -> None:
    resource = load_example("sessionserver.yaml")
    objects = render_sessionserver(resource, load_example("modelserver-qwen3-8b.yaml"))
    policy = next(o for o in objects if o["kind"] == "StatefulSet")["spec"][
        "persistentVolumeClaimRetentionPolicy"
    ]
    assert policy["whenDeleted"] == "Delete"
    resource["spec"]["redis"]["managed"]["retain"] = True
    objects = render_sessionserver(resource, load_example("modelserver-qwen3-8b.yaml"))
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    assert redis.url("rollouts", TEST_NAMESPACE).startswith("redis://rollouts-redis-0.")


def test_routing_replay_switch_adds_the_engine_flag() -> None:
    def args(modelserver: dict[str, Any]) -> list[str]:
        return render_modelserver(modelserver)[-1]["spec"]["template"]["spec"]["containers"][0][
            "args"
        ]

    modelserver = pvc_modelserver()
    assert "--enable-return-routed-experts" not in args(modelserver)
    modelserver["spec"]["engine"]["returnRoutedExperts"] = True
    assert "--enable-return-routed-experts" in args(modelserver)


def test_cpu_engine_requests_no_gpu_and_fits_a_two_cpu_node() -> None:
    deployment = next(d for d in SCENARIOS["modelserver-cpu"]() if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "250m", "memory": "6Gi"},
        "limits": {"memory": "6Gi"},
    }
    assert container["command"] == ["vllm", "serve"]
    assert container["args"][0] == "/models/tiny-qwen3"  # file:///models/tiny-qwen3
    assert "--gpu-memory-utilization" not in container["args"]
    assert "--enable-scale-out" in container["args"]  # the token-in endpoint
    assert not any(v["name"] == "model" for v in deployment["spec"]["template"]["spec"]["volumes"])


def test_file_model_tokenizer_is_copied_from_the_engine_image() -> None:
    objects = SCENARIOS["sessionserver-cpu"]()
    config = next(d for d in objects if d["kind"] == "ConfigMap")
    assert config["data"]["TOKENKEEP_TOKENIZER"] == session.TOKENIZER_PATH
    pod = next(d for d in objects if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == "tokenkeep/vllm-cpu:0.32.0-local"
    assert init["imagePullPolicy"] == "Never"
    script = init["command"][2]
    assert script.startswith("find '/models/tiny-qwen3' -maxdepth 1 -type f")
    assert "! -name '*.safetensors'" in script and script.endswith(f"{session.TOKENIZER_PATH}/ ';'")
    (container,) = pod["containers"]
    assert {"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True} in container[
        "volumeMounts"
    ]
    redis_args = next(d for d in objects if d["kind"] == "StatefulSet")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    # Debian's redis-server (make images) answers pod clients only with protected mode off.
    assert redis_args[1:3] == ["--protected-mode", "no"]


# --- NetworkPolicies --------------------------------------------------------------------


def _admits(policy: dict[str, Any], namespace: str, pod_labels: dict[str, str], port: int) -> bool:
    """Whether `policy` lets a pod of `namespace` with `pod_labels` connect to `port` of the
    pods it selects, as the NetworkPolicy API defines it: a rule without `from` (or
    without `ports`) admits every source (or port); a podSelector peer without a
    namespaceSelector means the policy's own namespace. Constructs the operator does not
    render fail the test rather than being guessed at."""
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"], spec
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p["port"] == port and p["protocol"] == "TCP" for p in ports):
            continue
        if not rule.get("from"):
            return True
        for peer in rule["from"]:
            assert list(peer) == ["podSelector"] and list(peer["podSelector"]) == ["matchLabels"]
            wanted = peer["podSelector"]["matchLabels"]
            same_namespace = namespace == policy["metadata"]["namespace"]
            if same_namespace and wanted.items() <= pod_labels.items():
                return True
    return False


def _selects(policy: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    return policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()


def _pod_labels(objects: list[dict[str, Any]], kind: str) -> dict[str, str]:
    workload = next(o for o in objects if o["kind"] == kind)
    return workload["spec"]["template"]["metadata"]["labels"]


def _policy(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    return policy


def _other_sessionserver(model_server: str) -> dict[str, Any]:
    resource = load_example("sessionserver.yaml")
    return {
        **resource,
        "metadata": {"name": "other"},
        "spec": {"modelServerRef": {"name": model_server}},
    }


def test_engines_admit_only_their_session_servers_and_trainers() -> None:
    model_server = load_example("modelserver-qwen3-8b.yaml")
    engine_objects = render_modelserver(model_server)
    policy = _policy(engine_objects)
    assert _selects(policy, _pod_labels(engine_objects, "Deployment"))
    sessions = _pod_labels(SCENARIOS["sessionserver-managed-redis"](), "Deployment")
    trainer = {"tokenkeep.dev/trainer": "qwen3-8b", "job-name": "grpo"}
    assert _admits(policy, TEST_NAMESPACE, sessions, engine.PORT)
    assert _admits(policy, TEST_NAMESPACE, trainer, engine.PORT)
    # Only the engine port: nothing else the pod might listen on.
    assert not _admits(policy, TEST_NAMESPACE, sessions, 8080)
    other_model_sessions = _pod_labels(SCENARIOS["sessionserver-external-redis"](), "Deployment")
    refused = [
        (TEST_NAMESPACE, other_model_sessions),  # a session server of another ModelServer
        (TEST_NAMESPACE, {"tokenkeep.dev/trainer": "llama-70b"}),  # another model's trainer
        ("elsewhere", sessions),  # the very labels, in another namespace
        ("elsewhere", trainer),
        (TEST_NAMESPACE, {"app": "harness-sandbox"}),  # any other pod
        (TEST_NAMESPACE, {}),
        (TEST_NAMESPACE, _pod_labels(SCENARIOS["sessionserver-managed-redis"](), "StatefulSet")),
    ]
    for namespace, pod_labels in refused:
        assert not _admits(policy, namespace, pod_labels, engine.PORT), (namespace, pod_labels)


def test_managed_redis_admits_only_its_own_session_server() -> None:
    objects = SCENARIOS["sessionserver-managed-redis"]()
    policy = _policy(objects)
    assert _selects(policy, _pod_labels(objects, "StatefulSet"))
    assert not _selects(policy, _pod_labels(objects, "Deployment"))  # harnesses reach these
    sessions = _pod_labels(objects, "Deployment")
    assert _admits(policy, TEST_NAMESPACE, sessions, redis.PORT)
    assert not _admits(policy, TEST_NAMESPACE, sessions, engine.PORT)
    neighbour = render_sessionserver(
        _other_sessionserver("qwen3-8b"), load_example("modelserver-qwen3-8b.yaml")
    )
    refused = [
        (TEST_NAMESPACE, _pod_labels(neighbour, "Deployment")),  # same model, other server
        (TEST_NAMESPACE, {"tokenkeep.dev/trainer": "qwen3-8b"}),
        (
            TEST_NAMESPACE,
            _pod_labels(
                render_modelserver(load_example("modelserver-qwen3-8b.yaml")), "Deployment"
            ),
        ),
        ("elsewhere", sessions),
        (TEST_NAMESPACE, {"app": "harness-sandbox"}),
    ]
    for namespace, pod_labels in refused:
        assert not _admits(policy, namespace, pod_labels, redis.PORT), (namespace, pod_labels)


def test_network_policies_can_be_turned_off() -> None:
    model_server = load_example("modelserver-qwen3-8b.yaml")
    model_server["spec"]["networkPolicy"] = {"enabled": False}
    sessions = load_example("sessionserver.yaml")
    sessions["spec"]["networkPolicy"] = {"enabled": False}
    for objects in (render_modelserver(model_server), render_sessionserver(sessions, model_server)):
        assert "NetworkPolicy" not in {o["kind"] for o in objects}
    # External Redis: nothing of ours to guard.
    assert "NetworkPolicy" not in {o["kind"] for o in SCENARIOS["sessionserver-external-redis"]()}


# --- policy publishing: the engine key, the extension, the checkpoint volume -----------------


def _engine_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _cpu_pair(**policy: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    model_server = load_example("cpu/modelserver.yaml")
    if policy:
        model_server["spec"]["policy"] = policy
    engines = render_modelserver(model_server)
    sessions = render_sessionserver(load_example("cpu/sessionserver.yaml"), model_server)
    return engines, sessions


def test_engines_start_ready_to_publish_behind_a_generated_engine_key() -> None:
    """By default vLLM runs with its development endpoints, tokenkeep's reload and the key
    middleware; the key comes from the Secret the operator generates, and the SessionServer
    of this ModelServer reads the same key, which is what it sends to the engines."""
    from session_server.devtools.localengine import PUBLISHING_ARGS

    engines, sessions = _cpu_pair()
    pod = _engine_pod(engines)
    (vllm,) = pod["containers"]
    args = vllm["args"]
    start = args.index(PUBLISHING_ARGS[0])
    assert tuple(args[start : start + len(PUBLISHING_ARGS)]) == PUBLISHING_ARGS
    assert _flag(args, "--middleware") == "tokenkeep_vllm.EngineKey"
    env = _env(vllm)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    key_ref = {"secretKeyRef": {"name": "tiny-qwen3-engine-key", "key": "engine-key"}}
    assert env["TOKENKEEP_ENGINE_KEY"] == key_ref
    (session_container,) = _engine_pod(sessions)["containers"]
    assert _env(session_container)["TOKENKEEP_ENGINE_KEY"] == key_ref
    # The Secret the reconciler creates once is the one both name; a new key each time.
    owner = owner_of(load_example("cpu/modelserver.yaml"))
    secret = engine.engine_key_secret(owner)
    assert secret["metadata"]["name"] == "tiny-qwen3-engine-key"
    assert len(secret["stringData"]["engine-key"]) >= 40
    assert engine.engine_key_secret(owner)["stringData"] != secret["stringData"]
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "ModelServer"
    validate_builtin(secret)
    # The kubelet's probes carry no key: they hit /health, which the middleware leaves open.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"]["path"] == "/health"


def test_the_engine_pod_refuses_publishing_endpoints_without_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs the engine pod's init container command (into a temporary folder) and loads the
    middleware its vLLM is told to, the way vLLM does, from the PYTHONPATH the pod sets, with
    the key the pod's environment names: /collective_rpc and /update_weight_version are
    refused (401) without it and with a wrong one, /health answers without it."""
    import asyncio
    import importlib
    import sys

    pod = _engine_pod(_cpu_pair()[0])
    (init,) = pod["initContainers"]
    (vllm,) = pod["containers"]
    path = _env(vllm)["PYTHONPATH"]
    shared = {m["name"] for m in init["volumeMounts"] if m["mountPath"] == path}
    assert shared and shared <= {m["name"] for m in vllm["volumeMounts"] if m["mountPath"] == path}
    assert init["command"][:2] == ["python", "-c"]
    exec(init["command"][2].replace(path, str(tmp_path)), {})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TOKENKEEP_ENGINE_KEY", "the-engine-key")
    module_name, _, cls = _flag(vllm["args"], "--middleware").rpartition(".")
    sys.modules.pop(module_name, None)
    module = importlib.import_module(module_name)
    assert Path(module.__file__).parent == tmp_path
    sys.modules.pop(module_name, None)

    async def endpoint(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = getattr(module, cls)(endpoint)

    def status(path: str, key: str | None = None) -> int:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        asyncio.run(middleware(scope, receive, send))
        return sent[0]["status"]

    for guarded in ("/collective_rpc", "/update_weight_version", "/pause", "/v1/models"):
        assert status(guarded) == 401, guarded
        assert status(guarded, "wrong") == 401, guarded
        assert status(guarded, "the-engine-key") == 200, guarded
    assert status("/health") == 200
    assert status("/metrics") == 200  # the chart's PodMonitor scrapes without a key


def test_publishing_off_runs_plain_vllm_and_no_key_anywhere() -> None:
    engines, sessions = _cpu_pair(publishing=False)
    pod = _engine_pod(engines)
    (vllm,) = pod["containers"]
    assert "--middleware" not in vllm["args"] and "--worker-extension-cls" not in vllm["args"]
    assert {"VLLM_SERVER_DEV_MODE", "TOKENKEEP_ENGINE_KEY", "PYTHONPATH"}.isdisjoint(_env(vllm))
    assert "initContainers" not in pod
    (session_container,) = _engine_pod(sessions)["containers"]
    assert "TOKENKEEP_ENGINE_KEY" not in _env(session_container)


def test_a_named_engine_key_secret_goes_to_engines_and_session_servers() -> None:
    engines, sessions = _cpu_pair(engineKeySecretRef={"name": "keys", "key": "engine"})
    ref = {"secretKeyRef": {"name": "keys", "key": "engine"}}
    (vllm,) = _engine_pod(engines)["containers"]
    (session_container,) = _engine_pod(sessions)["containers"]
    assert _env(vllm)["TOKENKEEP_ENGINE_KEY"] == _env(session_container)["TOKENKEEP_ENGINE_KEY"]
    assert _env(vllm)["TOKENKEEP_ENGINE_KEY"] == ref


@pytest.mark.parametrize("mount_path", [None, "/ckpt"])
def test_the_checkpoint_claim_is_read_only_at_one_path_in_engines_and_session_servers(
    mount_path: str | None,
) -> None:
    """POST /policy names a folder the session server validates and every engine reloads:
    the trainer's claim is mounted read-only, at the same path, in both kinds of pod."""
    checkpoints = {"claimName": "rl-checkpoints"} | (
        {"mountPath": mount_path} if mount_path else {}
    )
    engines, sessions = _cpu_pair(checkpoints=checkpoints)
    expected = mount_path or "/checkpoints"
    for objects in (engines, sessions):
        pod = _engine_pod(objects)
        (volume,) = [v for v in pod["volumes"] if "rl-checkpoints" in str(v)]
        assert volume["persistentVolumeClaim"] == {"claimName": "rl-checkpoints", "readOnly": True}
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": expected, "readOnly": True}
        for obj in objects:
            validate_builtin(obj)
    # Without the field, neither kind of pod mounts anything of the sort.
    for objects in _cpu_pair():
        assert "rl-checkpoints" not in str(objects) and expected not in str(objects)


def test_a_pod_template_conflict_is_one_warning_event_per_change() -> None:
    """The reconciler reports what the operator overrode once, not on every reconcile, and
    again when the set of conflicts changes."""
    from tests.operator.test_status import FakeKube
    from tokenkeep_operator.reconcile import POD_TEMPLATE_CONFLICT, Reconciler

    kube = FakeKube(None)
    reconciler = Reconciler(kube, IMAGE)  # type: ignore[arg-type]
    body = {"kind": "ModelServer", "metadata": {"name": "m", "namespace": "rl", "uid": "u"}}
    conflict = "spec.podTemplate.spec.enableServiceLinks: True ignored, the operator sets False"
    reconciler._report_conflicts(body, [conflict])
    reconciler._report_conflicts(body, [conflict])
    assert kube.events == [("Warning", POD_TEMPLATE_CONFLICT, conflict)]
    reconciler._report_conflicts(body, [])  # fixed
    reconciler._report_conflicts(body, [conflict])  # and back
    assert len(kube.events) == 2
