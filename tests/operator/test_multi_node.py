"""Multi-node engines (`parallelism.nodes > 1`): what the LeaderWorkerSet rendering gives the
people and programs that rely on it. The launch itself is checked by vLLM's own config code
(`test_vllm_cli.py`), the objects by the pinned LWS CRD and the real API server
(`test_manifests.py`, `test_real_cluster.py`)."""

from __future__ import annotations

from typing import Any

from tests.operator.conftest import load_example, owner_of
from tests.operator.test_manifests import (
    IMAGE,
    _flag,
    lws_crd,
    render_modelserver,
    two_node_pipeline_modelserver,
)
from tokenkeep_operator import status as st
from tokenkeep_operator.manifests import engine, podtemplate
from tokenkeep_operator.models import ModelServerSpec


def _lws_spec_schema() -> dict[str, Any]:
    return lws_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _objects(resource: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["kind"] + "/" + o["metadata"]["name"]: o for o in render_modelserver(resource)}


def _moe() -> dict[str, Any]:
    return load_example("gpu/moe-two-nodes.yaml")


def _group(resource: dict[str, Any]) -> dict[str, Any]:
    (lws,) = [o for o in render_modelserver(resource) if o["kind"] == "LeaderWorkerSet"]
    return lws


def _vllm(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")


def test_a_two_node_engine_is_one_group_per_replica_and_no_deployment() -> None:
    resource = _moe()
    resource["spec"]["replicas"] = 3
    objects = _objects(resource)
    assert not [k for k in objects if k.startswith("Deployment/")]
    lws = objects["LeaderWorkerSet/deepseek-v3-2n-engine-lws"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 3
    assert spec["leaderWorkerTemplate"]["size"] == 2
    # Workers start with the leader (its /health waits for them), a lost pod restarts the
    # whole group, and updates replace one group at a time without spare nodes.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxUnavailable": 1,
        "maxSurge": 0,
        "partition": 0,
    }


def test_every_default_the_lws_webhook_would_fill_is_rendered() -> None:
    """No LWS webhook runs where the operator is tested (and a later LWS may default
    otherwise): every field of the pinned CRD's spec that has a default is rendered, wherever
    its parent is (the pod templates are checked as Kubernetes pods elsewhere)."""

    def missing(schema: dict[str, Any], value: dict[str, Any], where: str) -> list[str]:
        found = []
        for name, prop in schema.get("properties", {}).items():
            if name in {"leaderTemplate", "workerTemplate", "volumeClaimTemplates"}:
                continue
            if name not in value:
                found += [f"{where}.{name}"] if "default" in prop else []
            elif isinstance(value[name], dict):
                found += missing(prop, value[name], f"{where}.{name}")
        return found

    for resource in (_moe(), two_node_pipeline_modelserver()):
        assert missing(_lws_spec_schema(), _group(resource)["spec"], "spec") == []


def test_the_leader_serves_and_is_probed_the_workers_run_headless() -> None:
    group = _group(_moe())["spec"]["leaderWorkerTemplate"]
    leader, worker = _vllm(group["leaderTemplate"]), _vllm(group["workerTemplate"])
    assert leader["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    assert "--headless" not in leader["args"]
    assert "--headless" in worker["args"]
    for container, rank in ((leader, "0"), (worker, "$(LWS_WORKER_INDEX)")):
        args = container["args"]
        assert _flag(args, "--nnodes") == "2"
        assert _flag(args, "--node-rank") == rank
        assert _flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert _flag(args, "--data-parallel-address") == "$(LWS_LEADER_ADDRESS)"
        assert _flag(args, "--data-parallel-size") == "16"
        assert _flag(args, "--data-parallel-size-local") == "8"
        assert "--enable-expert-parallel" in args
        # Every GPU of the pod is one of its 8 local ranks.
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_tensor_and_pipeline_across_nodes_render_no_data_parallel_flags() -> None:
    group = _group(two_node_pipeline_modelserver())["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        args = _vllm(group[role])["args"]
        assert _flag(args, "--tensor-parallel-size") == "8"
        assert _flag(args, "--pipeline-parallel-size") == "2"
        assert not [a for a in args if a.startswith("--data-parallel")]


def test_workers_load_what_the_leader_loads() -> None:
    """Published weights are loaded by every rank: the workers carry the extension, the
    engine key, the checkpoint claim and the model cache as the leader does, and the user's
    pod template (RDMA, IPC_LOCK) reaches both."""
    group = _group(two_node_pipeline_modelserver())["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    for key in ("initContainers", "volumes", "serviceAccountName"):
        assert worker[key] == leader[key]
    assert _vllm({"spec": worker})["env"] == _vllm({"spec": leader})["env"]
    assert _vllm({"spec": worker})["volumeMounts"] == _vllm({"spec": leader})["volumeMounts"]
    moe = _group(_moe())["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        container = _vllm(moe[role])
        assert container["resources"]["limits"]["rdma/ib"] == "1"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_each_pod_gets_its_own_cache_claim() -> None:
    """The pods of a group run on different nodes: a ReadWriteOnce claim shared by them
    could not mount on the second node, so the cache is a claim per pod."""
    resource = two_node_pipeline_modelserver()  # cache 1Ti, retained
    objects = _objects(resource)
    assert not [k for k in objects if k.startswith("PersistentVolumeClaim/")]
    group = objects["LeaderWorkerSet/llama-405b-engine-lws"]["spec"]["leaderWorkerTemplate"]
    assert group["volumeClaimTemplates"] == [
        {
            "metadata": {"name": "cache"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Ti"}},
            },
        }
    ]
    assert group["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    # The claim template supplies the volume: no pod volume of that name.
    assert "cache" not in {v["name"] for v in group["leaderTemplate"]["spec"]["volumes"]}
    assert _vllm(group["leaderTemplate"])["volumeMounts"][0] == {
        "name": "cache",
        "mountPath": "/cache",
    }


def test_services_list_one_engine_per_group_policies_cover_every_pod() -> None:
    """The session servers discover engines through the headless Service's DNS records:
    leaders only (worker index 0), one per replica. The NetworkPolicy lets the group's pods
    reach each other on any port; the disruption budget counts every pod."""
    objects = _objects(_moe())
    every_pod = engine.pod_selector(owner_of(_moe()))
    leaders = {**every_pod, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert objects["Service/deepseek-v3-2n-engine"]["spec"]["selector"] == leaders
    assert objects["Service/deepseek-v3-2n-engine-pods"]["spec"]["selector"] == leaders
    assert objects["PodDisruptionBudget/deepseek-v3-2n-engine"]["spec"]["selector"] == {
        "matchLabels": every_pod
    }
    policy = objects["NetworkPolicy/deepseek-v3-2n-engine"]["spec"]
    assert policy["podSelector"] == {"matchLabels": every_pod}
    peers, group = policy["ingress"]
    assert peers["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert group == {"from": [{"podSelector": {"matchLabels": every_pod}}]}
    # One node: no worker-index in the selectors (the Deployment's pods carry none).
    single = load_example("gpu/moe-dp8-ep.yaml")
    service = _objects(single)[f"Service/{single['metadata']['name']}-engine"]
    assert service["spec"]["selector"] == engine.pod_selector(owner_of(single))


def test_pod_template_conflicts_are_found_in_the_leader_pod() -> None:
    resource = _moe()
    resource["spec"]["podTemplate"]["spec"]["containers"][0]["args"] = ["--model", "x"]
    spec = ModelServerSpec.model_validate(resource["spec"])
    owner = owner_of(resource)
    conflicts = podtemplate.conflicts(lambda s: engine.render(owner, s, IMAGE), spec)
    assert [c.split(":")[0] for c in conflicts] == [
        "spec.podTemplate.spec.containers[name=vllm].args"
    ]


def test_status_follows_the_lws_and_copes_with_an_empty_one() -> None:
    """Without an LWS controller the LeaderWorkerSet has no status at all: the engine is
    starting, not ready. With ready groups at the current generation it is available."""
    lws = _group(_moe())
    lws["metadata"]["generation"] = 1
    empty = st.Workload(st.leader_worker_set_as_workload(lws))
    ready, progressing, degraded = st.workload_conditions(empty, 1, 1, what="vLLM")
    assert (ready["status"], ready["reason"]) == ("False", st.STARTING)
    assert ready["message"].startswith("0 of 1 replicas ready")
    assert progressing["status"] == "True" and degraded["status"] == "False"
    assert st.counts(empty) == {"replicas": 0, "readyReplicas": 0, "availableReplicas": 0}
    lws["status"] = {
        "observedGeneration": 1,
        "replicas": 1,
        "readyReplicas": 1,
        "updatedReplicas": 1,
    }
    running = st.Workload(st.leader_worker_set_as_workload(lws))
    ready, progressing, _ = st.workload_conditions(running, 1, 1, what="vLLM")
    assert (ready["status"], ready["reason"]) == ("True", st.AVAILABLE)
    assert progressing["reason"] == st.ROLLOUT_COMPLETE
    assert st.counts(running)["availableReplicas"] == 1
