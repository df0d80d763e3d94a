"""The operator against a real API server (see `real_cluster.py`), as the chart installs it:
its ServiceAccount, its RBAC, `OwnerReferencesPermissionEnforcement` on.

One control plane and one operator serve the whole module; every test works in a namespace
of its own. The tests play the kubelet and the scheduler where they need pods to move (by
writing pod status as the cluster admin), as nothing else runs them here.
"""

from __future__ import annotations

import base64
import copy
import itertools
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.conftest import load_example
from tests.operator.real_cluster import (
    Api,
    Cluster,
    OperatorProcess,
    eventually,
    missing_prerequisites,
    ms_path,
    path,
    ss_path,
)

pytestmark = pytest.mark.skipif(
    missing_prerequisites() is not None, reason=str(missing_prerequisites())
)

# Resources the operator writes (and the cluster's controllers do not), for counting writes.
OPERATOR_WRITES = {
    "deployments",
    "statefulsets",
    "services",
    "configmaps",
    "serviceaccounts",
    "persistentvolumeclaims",
    "poddisruptionbudgets",
    "networkpolicies",
    "leaderworkersets",
    "modelservers",
    "modelservers/status",
    "sessionservers",
    "sessionservers/status",
}
_namespaces = itertools.count(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = Cluster(tmp_path_factory.mktemp("k8s"))
    try:
        started.start()
        started.install_crds()
        started.token = started.install_chart_rbac()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def operator_kubeconfig(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cluster.user_kubeconfig(cluster.token, tmp_path_factory.mktemp("op") / "kubeconfig")


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("log") / "op.log")
    process.start()
    eventually(lambda: "leading" in process.output(), timeout=60)
    yield process
    assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output(), process.output()


@pytest.fixture
def admin(cluster: Cluster) -> Api:
    return cluster.admin


@pytest.fixture
def ns(admin: Api) -> str:
    return admin.namespace(f"t{next(_namespaces)}")


def create_example(api: Api, ns: str, example: str, **spec: Any) -> dict[str, Any]:
    body = load_example(example)
    body["metadata"]["namespace"] = ns
    body["spec"].update(spec)
    url = ms_path(ns) if body["kind"] == "ModelServer" else ss_path(ns)
    return api.create(url, body)


def conditions(obj: dict[str, Any] | None) -> dict[str, tuple[str, str]]:
    found = ((obj or {}).get("status") or {}).get("conditions") or []
    return {c["type"]: (c["status"], c["reason"]) for c in found}


def events(api: Api, ns: str, name: str) -> list[tuple[str, str, str]]:
    found = api.items(path("v1", "events", ns), fieldSelector=f"involvedObject.name={name}")
    found.sort(key=lambda e: (e.get("firstTimestamp") or "", e["metadata"]["resourceVersion"]))
    return [(e["type"], e["reason"], e["message"]) for e in found]


def deployment(api: Api, ns: str, name: str) -> dict[str, Any] | None:
    return api.get(path("apps/v1", "deployments", ns, name))


def engine_args(obj: dict[str, Any]) -> list[str]:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    return container.get("args") or container["command"]


def children(api: Api, ns: str) -> dict[str, dict[str, Any]]:
    """Every object the operator owns in `ns`, by `kind/name`."""
    found = {}
    for version, plural in [
        ("apps/v1", "deployments"),
        ("apps/v1", "statefulsets"),
        ("v1", "services"),
        ("v1", "configmaps"),
        ("v1", "serviceaccounts"),
        ("v1", "persistentvolumeclaims"),
        ("networking.k8s.io/v1", "networkpolicies"),
    ]:
        for item in api.items(
            path(version, plural, ns),
            labelSelector="app.kubernetes.io/managed-by=tokenkeep-operator",
        ):
            found[f"{plural}/{item['metadata']['name']}"] = item
    return found


def test_examples_get_their_children_status_and_events(
    cluster: Cluster, admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """Everything is created with controller owner references under the chart's RBAC (with
    OwnerReferencesPermissionEnforcement on), although 1.20 serves no policy/v1: the
    PodDisruptionBudgets are skipped with one Warning each and block nothing."""
    ms = create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    ss = create_example(admin, ns, "sessionserver.yaml")
    owned = eventually(lambda: len(children(admin, ns)) >= 13 and children(admin, ns))
    # 1.20 serves networking.k8s.io/v1: the engines' and Redis' policies are applied.
    assert {"networkpolicies/qwen3-8b-engine", "networkpolicies/rollouts-redis"} <= set(owned)
    for key, obj in owned.items():
        if key.startswith("persistentvolumeclaims/data-"):
            continue  # the StatefulSet's claim: owned by nobody unless retention says so
        refs = obj["metadata"].get("ownerReferences") or []
        assert [r["kind"] for r in refs if r.get("controller")] in (
            ["ModelServer"],
            ["SessionServer"],
        ), key

    def settled(url: str) -> dict[str, Any]:
        obj = admin.get(url)
        assert set(conditions(obj)) == {"Ready", "Progressing", "Degraded"}
        return obj

    ms_now = eventually(lambda: settled(ms_path(ns, "qwen3-8b")))
    status = ms_now["status"]
    assert status["url"] == f"http://qwen3-8b-engine.{ns}.svc:8000"
    assert status["observedGeneration"] == ms_now["metadata"]["generation"]
    assert conditions(ms_now)["Degraded"] == ("False", "AsExpected")
    eventually(lambda: settled(ss_path(ns, "rollouts")))

    # `kubectl get` shows no empty column (the URL column is -o wide only).
    for url in (ms_path(ns), ss_path(ns)):
        table = admin.table(url)
        for row in table["rows"]:
            assert all(cell not in ("", None) for cell in row["cells"]), (
                table["columnDefinitions"],
                row,
            )

    # `kubectl explain` has a description for every field.
    for field in ("modelserver.spec", "modelserver.spec.engine", "sessionserver.spec.redis"):
        explained = eventually(
            lambda field=field: (out := cluster.kubectl("explain", field)) and "<empty>" not in out
        )
        assert explained

    # Start-up is progress, not a problem: Normal events, except the one skipped PDB each.
    for name in (ms["metadata"]["name"], ss["metadata"]["name"]):
        posted = eventually(lambda name=name: events(admin, ns, name))
        warnings = [e for e in posted if e[0] == "Warning"]
        assert [w[1] for w in warnings] == ["APINotServed"], posted
        assert "policy/v1" in warnings[0][2]
        normal = [e[1] for e in posted if e[0] == "Normal"]
        assert normal, posted
        assert all(a != b for a, b in itertools.pairwise(normal)), posted

    # The counts mean what they say: the Deployment's pods exist, Pending (no scheduler).
    eventually(
        lambda: (
            "pods: 0 running, 1 pending"
            in dict(
                (c["type"], c["message"])
                for c in admin.get(ms_path(ns, "qwen3-8b"))["status"]["conditions"]
            )["Progressing"]
        )
    )


def test_hand_edits_are_undone_and_idle_makes_no_writes(
    cluster: Cluster, admin: Api, ns: str, operator: OperatorProcess
) -> None:
    create_example(admin, ns, "modelserver-qwen3-8b.yaml", replicas=3)
    name = "qwen3-8b-engine"
    desired = eventually(lambda: deployment(admin, ns, name))
    assert desired["spec"]["replicas"] == 3
    args = engine_args(desired)
    edited_args = [a.replace("32768", "1024") for a in args]
    assert edited_args != args
    container = copy.deepcopy(desired["spec"]["template"]["spec"]["containers"][0])
    field = "args" if container.get("args") else "command"
    container[field] = edited_args
    admin.patch(
        path("apps/v1", "deployments", ns, name),
        {"spec": {"replicas": 1, "template": {"spec": {"containers": [container]}}}},
    )
    edited_at = time.monotonic()
    reverted = eventually(
        lambda: (
            (d := deployment(admin, ns, name))["spec"]["replicas"] == 3
            and engine_args(d) == args
            and d
        ),
        timeout=10,
    )
    assert time.monotonic() - edited_at < 10
    # A deleted child comes back.
    admin.delete(path("v1", "services", ns, "qwen3-8b-engine"))
    eventually(lambda: admin.get(path("v1", "services", ns, "qwen3-8b-engine")), timeout=10)

    # Idle: the controllers settle (ReplicaSets, pods), then nothing the operator owns moves.
    # 15 s rather than 60: the work queue's longest pause between passes is its debounce (1 s),
    # and every event would have shown up well within 15 s.
    del reverted
    time.sleep(3)
    before = {k: v["metadata"]["resourceVersion"] for k, v in children(admin, ns).items()}
    ms_before = admin.get(ms_path(ns, "qwen3-8b"))["metadata"]["resourceVersion"]
    writes = cluster.write_count(OPERATOR_WRITES)
    time.sleep(15)
    after = {k: v["metadata"]["resourceVersion"] for k, v in children(admin, ns).items()}
    assert after == before
    assert admin.get(ms_path(ns, "qwen3-8b"))["metadata"]["resourceVersion"] == ms_before
    assert cluster.write_count(OPERATOR_WRITES) == writes


def test_a_network_policy_turned_off_is_deleted(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """Left behind, it would go on refusing the peers the user now means to let in."""
    create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    url = path("networking.k8s.io/v1", "networkpolicies", ns, "qwen3-8b-engine")
    policy = eventually(lambda: admin.get(url))
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    admin.patch(ms_path(ns, "qwen3-8b"), {"spec": {"networkPolicy": {"enabled": False}}})
    eventually(lambda: admin.get(url) is None, timeout=10)
    admin.patch(ms_path(ns, "qwen3-8b"), {"spec": {"networkPolicy": {"enabled": True}}})
    eventually(lambda: admin.get(url), timeout=10)


def condition_of(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    found = ((obj or {}).get("status") or {}).get("conditions") or []
    return next(c for c in found if c["type"] == type_)


def test_a_refused_child_blocks_nothing_and_is_retried(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """A quota refuses Services: everything else is applied, Degraded names the Service
    with the API server's message, and once the quota goes the retry creates it."""
    quota = {"metadata": {"name": "no-services"}, "spec": {"hard": {"services": "0"}}}
    admin.create(path("v1", "resourcequotas", ns), quota)
    eventually(lambda: admin.get(path("v1", "resourcequotas", ns, "no-services"))["status"]["hard"])
    create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    degraded = eventually(
        lambda: (
            (c := condition_of(admin.get(ms_path(ns, "qwen3-8b")), "Degraded"))["reason"]
            == "ApplyFailed"
            and c
        )
    )
    assert "Service qwen3-8b-engine:" in degraded["message"]
    assert "exceeded quota" in degraded["message"], degraded
    assert deployment(admin, ns, "qwen3-8b-engine") is not None
    ms = admin.get(ms_path(ns, "qwen3-8b"))
    assert set(conditions(ms)) == {"Ready", "Progressing", "Degraded"}
    assert ms["status"]["url"]
    admin.delete(path("v1", "resourcequotas", ns, "no-services"))
    eventually(lambda: admin.get(path("v1", "services", ns, "qwen3-8b-engine")), timeout=40)
    eventually(
        lambda: condition_of(admin.get(ms_path(ns, "qwen3-8b")), "Degraded")["status"] == "False",
        timeout=10,
    )
    kinds = [(e[0], e[1]) for e in events(admin, ns, "qwen3-8b")]
    assert kinds.count(("Warning", "ApplyFailed")) == 1, kinds


def test_owner_references_change_under_owner_reference_enforcement(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """Flipping cache.retain drops and restores the claim's owner reference: the chart's
    RBAC must allow it where OwnerReferencesPermissionEnforcement is on."""
    create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    claim_url = path("v1", "persistentvolumeclaims", ns, "qwen3-8b-model-cache")
    eventually(lambda: admin.get(claim_url)["metadata"]["ownerReferences"])
    admin.patch(ms_path(ns, "qwen3-8b"), {"spec": {"cache": {"retain": True}}})
    eventually(lambda: not admin.get(claim_url)["metadata"].get("ownerReferences"), timeout=10)
    admin.patch(ms_path(ns, "qwen3-8b"), {"spec": {"cache": {"retain": False}}})
    eventually(lambda: admin.get(claim_url)["metadata"].get("ownerReferences"), timeout=10)
    assert condition_of(admin.get(ms_path(ns, "qwen3-8b")), "Degraded")["status"] == "False"


def unschedulable(message: str) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
            }
        ],
    }


def test_claims_are_waited_for_until_the_scheduler_says_they_block(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """Pending claims with Pending pods (a WaitForFirstConsumer class before scheduling) are
    waiting, not Degraded; the scheduler refusing a pod for an unbound claim is. Both for
    the model cache and for the Redis claim."""
    create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    create_example(admin, ns, "sessionserver.yaml")
    ms = eventually(
        lambda: (
            (m := admin.get(ms_path(ns, "qwen3-8b")))
            and condition_of(m, "Ready")["reason"] == "WaitingForVolume"
            and m
        )
    )
    assert condition_of(ms, "Degraded")["status"] == "False"
    ss = eventually(
        lambda: (
            (s := admin.get(ss_path(ns, "rollouts")))
            and condition_of(s, "Ready")["reason"] == "RedisNotReady"
            and "data-rollouts-redis-0" in condition_of(s, "Ready")["message"]
            and s
        )
    )
    assert condition_of(ss, "Degraded")["status"] == "False"

    message = "0/3 nodes are available: 3 pod has unbound immediate PersistentVolumeClaims."
    for selector in (
        "app.kubernetes.io/instance=qwen3-8b,app.kubernetes.io/component=engine",
        "app.kubernetes.io/instance=rollouts,app.kubernetes.io/name=redis",
    ):
        pods = eventually(
            lambda selector=selector: admin.items(path("v1", "pods", ns), labelSelector=selector)
        )
        for pod in pods:
            url = path("v1", "pods", ns, pod["metadata"]["name"]) + "/status"
            admin.patch(url, {"status": unschedulable(message)})
    eventually(
        lambda: (
            condition_of(admin.get(ms_path(ns, "qwen3-8b")), "Degraded")["reason"] == "PVCPending"
        )
    )
    degraded = eventually(
        lambda: (
            (c := condition_of(admin.get(ss_path(ns, "rollouts")), "Degraded"))["reason"]
            == "PVCPending"
            and c
        )
    )
    assert degraded["message"].startswith("Redis: ")


def test_invalid_specs_are_reported_in_field_paths(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """A rule 1.20 cannot enforce (CEL) is enforced by the operator: InvalidSpec on every
    condition, the resource's own field path, no children, one Warning."""
    create_example(
        admin,
        ns,
        "modelserver-qwen3-8b.yaml",
        resources={"gpus": 3},
        engine={"tensorParallelSize": 2},
    )
    ms = eventually(
        lambda: (
            (m := admin.get(ms_path(ns, "qwen3-8b")))
            and condition_of(m, "Ready")["reason"] == "InvalidSpec"
            and m
        )
    )
    assert conditions(ms) == {
        t: (s, "InvalidSpec")
        for t, s in [("Ready", "False"), ("Progressing", "False"), ("Degraded", "True")]
    }
    message = condition_of(ms, "Degraded")["message"]
    assert message.startswith("spec.resources.gpus: "), message
    assert "Value error" not in message
    assert children(admin, ns) == {}
    assert [e[:2] for e in events(admin, ns, "qwen3-8b")] == [("Warning", "InvalidSpec")]


def test_a_two_node_engine_waits_for_the_lws_api_then_runs_as_one_group_per_replica(
    cluster: Cluster, admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """examples/gpu/moe-two-nodes.yaml. Without the LeaderWorkerSet CRD: LeaderWorkerSetMissing
    with the install hint, nothing deployed (as for an invalid spec). Once the pinned LWS
    CRD is installed (`kubectl create`: its `apply` annotation would be too long) the operator
    notices it by itself and creates the LeaderWorkerSet; with no LWS controller here its
    status stays empty (starting), and the status a controller would write (one ready group)
    makes the ModelServer ready. What the operator renders is also accepted whole by the API
    server (`kubectl create --dry-run=server`)."""
    from tests.operator.test_manifests import LWS_CRD, render_modelserver

    create_example(admin, ns, "gpu/moe-two-nodes.yaml")
    name = "deepseek-v3-2n"
    ms = eventually(
        lambda: (
            (m := admin.get(ms_path(ns, name)))
            and condition_of(m, "Ready")["reason"] == "LeaderWorkerSetMissing"
            and m
        )
    )
    message = condition_of(ms, "Degraded")["message"]
    assert "install the LeaderWorkerSet controller" in message, message
    assert "lws/releases/download/v0.10.0/manifests.yaml" in message
    assert condition_of(ms, "Degraded")["status"] == "True"
    assert children(admin, ns) == {}

    def warnings() -> list[str]:
        return sorted(e[1] for e in events(admin, ns, name) if e[0] == "Warning")

    # One Warning (checked again at the end: not one per recheck).
    assert eventually(lambda: warnings() == ["LeaderWorkerSetMissing"])

    cluster.kubectl("create", "-f", str(LWS_CRD))
    lws_url = path("leaderworkerset.x-k8s.io/v1", "leaderworkersets", ns, f"{name}-engine-lws")
    lws = eventually(lambda: admin.get(lws_url), timeout=45)
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "ModelServer"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    owned = children(admin, ns)
    assert not [k for k in owned if k.startswith("deployments/")]
    selector = owned["services/deepseek-v3-2n-engine-pods"]["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert "status" not in lws or not lws["status"].get("readyReplicas")
    starting = eventually(
        lambda: (
            (m := admin.get(ms_path(ns, name)))
            and condition_of(m, "Ready")["reason"] == "Starting"
            and m
        )
    )
    assert condition_of(starting, "Degraded")["status"] == "False"

    group_ready = {
        "observedGeneration": lws["metadata"]["generation"],
        "replicas": 1,
        "readyReplicas": 1,
        "updatedReplicas": 1,
    }
    admin.patch(lws_url + "/status", {"status": group_ready})
    ready = eventually(
        lambda: (
            (m := admin.get(ms_path(ns, name)))
            and condition_of(m, "Ready")["status"] == "True"
            and m
        )
    )
    assert ready["status"]["readyReplicas"] == 1
    # ... and, once applied, 1.20's skipped PodDisruptionBudget.
    assert warnings() == ["APINotServed", "LeaderWorkerSetMissing"]

    # Back to one node (8 ranks on one pod): the LeaderWorkerSet goes, a Deployment comes,
    # and the Services select its pods again (they carry no worker index).
    one_node = {"nodes": 1, "data": 8, "dataLocal": None}
    admin.patch(ms_path(ns, name), {"spec": {"parallelism": one_node}})
    eventually(lambda: admin.get(lws_url) is None and deployment(admin, ns, f"{name}-engine"))
    eventually(
        lambda: (
            "leaderworkerset.sigs.k8s.io/worker-index"
            not in children(admin, ns)["services/deepseek-v3-2n-engine-pods"]["spec"]["selector"]
        )
    )

    example = load_example("gpu/moe-two-nodes.yaml")
    example["metadata"]["name"] = "dry-run"
    rendered = render_modelserver(example)
    for obj in rendered:
        obj["metadata"]["namespace"] = ns
    kinds = {o["kind"] for o in rendered}
    assert "LeaderWorkerSet" in kinds
    served = [o for o in rendered if o["kind"] != "PodDisruptionBudget"]  # 1.20: no policy/v1
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "create", "--dry-run=server",
         "-o", "name", "-f", "-"],
        input=yaml.safe_dump_all(served),
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "leaderworkerset.leaderworkerset.x-k8s.io/dry-run-engine-lws" in out.stdout


def test_a_pod_template_reaches_the_engine_pods_and_its_conflicts_are_one_warning(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """The merged Deployment is accepted by a real API server; the field the operator
    overrides (the GPU limit) is named in a PodTemplateConflict Warning."""
    create_example(
        admin,
        ns,
        "gpu/dense-8b.yaml",
        podTemplate={
            "metadata": {"annotations": {"example.com/team": "rl"}},
            "spec": {
                "imagePullSecrets": [{"name": "registry-creds"}],
                "volumes": [{"name": "datasets", "emptyDir": {}}],
                "containers": [
                    {
                        "name": "vllm",
                        "volumeMounts": [{"name": "datasets", "mountPath": "/data"}],
                        "resources": {"limits": {"nvidia.com/gpu": "2"}},
                        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                    }
                ],
            },
        },
    )
    engine_deployment = eventually(lambda: deployment(admin, ns, "qwen3-8b-engine"))
    template = engine_deployment["spec"]["template"]
    assert template["metadata"]["annotations"] == {"example.com/team": "rl"}
    pod = template["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    (vllm,) = pod["containers"]
    assert {"name": "datasets", "mountPath": "/data"} in vllm["volumeMounts"]
    assert vllm["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    warnings = eventually(
        lambda: [e for e in events(admin, ns, "qwen3-8b") if e[1] == "PodTemplateConflict"]
    )
    assert warnings == [
        (
            "Warning",
            "PodTemplateConflict",
            "spec.podTemplate.spec.containers[name=vllm].resources.limits.nvidia.com/gpu: "
            "'2' ignored, the operator sets '1'",
        )
    ]


def test_a_failed_status_write_is_an_event_and_retried(
    cluster: Cluster, admin: Api, ns: str, operator: OperatorProcess
) -> None:
    role_url = path("rbac.authorization.k8s.io/v1", "clusterroles", None, "tk-tokenkeep")
    role = admin.get(role_url)
    rules = role["rules"]
    without_status = [r for r in rules if not any(x.endswith("/status") for x in r["resources"])]
    admin.patch(role_url, {"rules": without_status})
    try:
        create_example(admin, ns, "modelserver-qwen3-8b.yaml")
        warning = eventually(
            lambda: [e for e in events(admin, ns, "qwen3-8b") if e[1] == "StatusWriteFailed"]
        )
        assert warning[0][0] == "Warning"
        assert "forbidden" in warning[0][2]
        time.sleep(6)  # past the first retry: the same failure is not reported again
        assert [e[1] for e in events(admin, ns, "qwen3-8b")].count("StatusWriteFailed") == 1
        assert deployment(admin, ns, "qwen3-8b-engine") is not None
    finally:
        admin.patch(role_url, {"rules": rules})
    eventually(lambda: admin.get(ms_path(ns, "qwen3-8b")).get("status"), timeout=40)


def test_lifecycle_with_a_restart_mid_reconcile(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """Create, scale (the scale subresource, as an autoscaler does), update and delete; the
    operator killed right after the create converges on restart without a second rollout."""
    create_example(admin, ns, "modelserver-llama-70b-tp4.yaml")
    time.sleep(0.3)
    operator.stop(signal.SIGKILL)
    operator.start()
    eventually(lambda: operator.output().count("leading") >= 2, timeout=30)
    create_example(admin, ns, "sessionserver.yaml", modelServerRef={"name": "llama-70b"})
    eventually(lambda: deployment(admin, ns, "llama-70b-engine"))
    eventually(lambda: deployment(admin, ns, "rollouts-sessions"))
    replica_sets = admin.items(
        path("apps/v1", "replicasets", ns), labelSelector="app.kubernetes.io/instance=llama-70b"
    )
    assert len(replica_sets) == 1

    admin.patch(ms_path(ns, "llama-70b") + "/scale", {"spec": {"replicas": 2}})
    eventually(
        lambda: deployment(admin, ns, "llama-70b-engine")["spec"]["replicas"] == 2, timeout=10
    )
    scale = admin.get(ms_path(ns, "llama-70b") + "/scale")
    assert scale["status"]["selector"], scale
    admin.patch(ss_path(ns, "rollouts"), {"spec": {"replicas": 3}})
    eventually(
        lambda: deployment(admin, ns, "rollouts-sessions")["spec"]["replicas"] == 3, timeout=10
    )
    ss = eventually(
        lambda: (
            (s := admin.get(ss_path(ns, "rollouts")))["status"]["observedGeneration"]
            == s["metadata"]["generation"]
            and s
        )
    )
    assert condition_of(ss, "Ready")["reason"] in {"ModelServerNotReady", "RedisNotReady"}

    admin.delete(ss_path(ns, "rollouts"))
    admin.delete(ms_path(ns, "llama-70b"))
    # No finalizers: the garbage collector removes every owned child. The StatefulSet's own
    # claim stays: its retention policy (Kubernetes 1.23+) is dropped by this 1.20 server.
    eventually(
        lambda: list(children(admin, ns)) == ["persistentvolumeclaims/data-rollouts-redis-0"],
        timeout=30,
    )


def test_the_operator_rides_out_an_api_server_restart(
    cluster: Cluster, admin: Api, ns: str, operator: OperatorProcess
) -> None:
    create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    eventually(lambda: deployment(admin, ns, "qwen3-8b-engine"))
    cluster.restart_apiserver()

    def edit_undone() -> bool:
        assert operator.process is not None
        if operator.process.poll() is not None:
            # It could not renew its Lease for longer than the Lease lasts (4 s here), so it
            # stopped, as it must: another replica may hold the Lease by now. The kubelet
            # would restart it; so does the test.
            assert operator.process.returncode == 1, operator.output()
            assert "lost; stopping" in operator.output()
            operator.start()
        # Once its watches are back, a hand edit is undone as before.
        admin.patch(
            path("apps/v1", "deployments", ns, "qwen3-8b-engine"), {"spec": {"replicas": 4}}
        )
        return eventually(
            lambda: deployment(admin, ns, "qwen3-8b-engine")["spec"]["replicas"] == 1, timeout=10
        )

    eventually(edit_undone, timeout=60, interval=1)


def test_sessionserver_gets_a_generated_admin_key(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """Without apiKeySecretRef the operator creates `<name>-admin-key` once, as the chart's
    ServiceAccount (create-only on Secrets, under owner-reference enforcement), hands it to
    the session server's pods, and never rewrites it on later reconciles."""
    create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    body = load_example("sessionserver.yaml")
    body["metadata"]["namespace"] = ns
    del body["spec"]["apiKeySecretRef"]
    admin.create(ss_path(ns), body)
    secret_url = path("v1", "secrets", ns, "rollouts-admin-key")
    secret = eventually(lambda: admin.get(secret_url))
    key = secret["data"]["admin-key"]
    assert len(key) >= 40
    assert [r["kind"] for r in secret["metadata"]["ownerReferences"]] == ["SessionServer"]
    sessions = eventually(lambda: deployment(admin, ns, "rollouts-sessions"))
    env = sessions["spec"]["template"]["spec"]["containers"][0]["env"]
    admin_env = next(e for e in env if e["name"] == "TOKENKEEP_ADMIN_KEY")
    assert admin_env["valueFrom"]["secretKeyRef"] == {
        "name": "rollouts-admin-key",
        "key": "admin-key",
    }
    # The managed Redis's password: one generated Secret, read by Redis and the sessions.
    password_url = path("v1", "secrets", ns, "rollouts-redis-password")
    password = eventually(lambda: admin.get(password_url))["data"]["password"]
    assert len(base64.b64decode(password)) == 64
    generated = {"name": "rollouts-redis-password", "key": "password"}
    redis_env = eventually(
        lambda: admin.get(path("apps/v1", "statefulsets", ns, "rollouts-redis"))
    )["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis_env} == {
        "REDIS_PASSWORD": generated,
        "REDISCLI_AUTH": generated,
    }
    session_password = next(e for e in env if e["name"] == "TOKENKEEP_REDIS_PASSWORD")
    assert session_password["valueFrom"]["secretKeyRef"] == generated
    admin.patch(ss_path(ns, "rollouts"), {"spec": {"replicas": 1}})
    eventually(lambda: deployment(admin, ns, "rollouts-sessions")["spec"]["replicas"] == 1)
    assert admin.get(secret_url)["data"]["admin-key"] == key
    assert admin.get(password_url)["data"]["password"] == password  # never rewritten
    assert conditions(admin.get(ss_path(ns, "rollouts")))["Degraded"][0] == "False"


def test_modelserver_gets_a_generated_engine_key_its_session_servers_share(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """Publishing is on by default: the operator creates `<modelserver>-engine-key` once (as
    the chart's ServiceAccount, under owner-reference enforcement), the engine pods and the
    SessionServer's pods read the same key from it, and a later reconcile never rewrites it.
    The SessionServer's Policy column says `unknown` while no session server can be asked."""
    create_example(admin, ns, "modelserver-qwen3-8b.yaml")
    create_example(admin, ns, "sessionserver.yaml")
    secret_url = path("v1", "secrets", ns, "qwen3-8b-engine-key")
    secret = eventually(lambda: admin.get(secret_url))
    key = secret["data"]["engine-key"]
    assert len(key) >= 40
    assert [r["kind"] for r in secret["metadata"]["ownerReferences"]] == ["ModelServer"]
    ref = {"name": "qwen3-8b-engine-key", "key": "engine-key"}
    for name in ("qwen3-8b-engine", "rollouts-sessions"):
        found = eventually(lambda name=name: deployment(admin, ns, name))
        env = found["spec"]["template"]["spec"]["containers"][0]["env"]
        key_env = next(e for e in env if e["name"] == "TOKENKEEP_ENGINE_KEY")
        assert key_env["valueFrom"]["secretKeyRef"] == ref, name
    engine = deployment(admin, ns, "qwen3-8b-engine")
    assert "tokenkeep_vllm.EngineKey" in engine_args(engine)
    admin.patch(ms_path(ns, "qwen3-8b"), {"spec": {"drainSeconds": 61}})
    eventually(lambda: "61" in engine_args(deployment(admin, ns, "qwen3-8b-engine")))
    assert admin.get(secret_url)["data"]["engine-key"] == key
    policy = eventually(
        lambda: (admin.get(ss_path(ns, "rollouts")).get("status") or {}).get("policy")
    )
    assert policy["summary"] == "unknown" and policy["message"], policy


def test_an_sglang_modelserver_runs_sglang_and_can_switch_kinds_in_place(
    admin: Api, ns: str, operator: OperatorProcess
) -> None:
    """examples/gpu/sglang-moe-dp8-ep.yaml: the Deployment runs SGLang's server behind the
    generated engine key and its SessionServer is told to speak SGLang; switched to vllm in
    place, the same Deployment (its selector cannot change) runs vLLM and the SessionServer
    follows; what SGLang cannot run (gpus 0) is refused and leaves the engine as it was."""
    create_example(admin, ns, "gpu/sglang-moe-dp8-ep.yaml")
    create_example(admin, ns, "sessionserver.yaml", modelServerRef={"name": "deepseek-v3-sglang"})
    name = "deepseek-v3-sglang"
    config_url = path("v1", "configmaps", ns, "rollouts-sessions-config")

    def engine_container() -> dict[str, Any] | None:
        found = deployment(admin, ns, f"{name}-engine")
        return found and found["spec"]["template"]["spec"]["containers"][0]

    container = eventually(engine_container)
    assert container["name"] == "sglang"
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    args = container["args"]
    assert args[args.index("--api-key") + 1] == "$(TOKENKEEP_ENGINE_KEY)"
    key_ref = {"name": f"{name}-engine-key", "key": "engine-key"}
    key_env = next(e for e in container["env"] if e["name"] == "TOKENKEEP_ENGINE_KEY")
    assert key_env["valueFrom"]["secretKeyRef"] == key_ref
    eventually(lambda: admin.get(path("v1", "secrets", ns, f"{name}-engine-key")))
    kind = eventually(
        lambda: (admin.get(config_url) or {}).get("data", {}).get("TOKENKEEP_ENGINE_KIND")
    )
    assert kind == "sglang"

    admin.patch(ms_path(ns, name), {"spec": {"engine": {"kind": "vllm"}}})
    eventually(lambda: engine_container()["name"] == "vllm")
    assert "tokenkeep_vllm.EngineKey" in engine_container()["args"]
    eventually(lambda: admin.get(config_url)["data"]["TOKENKEEP_ENGINE_KIND"] == "vllm")

    admin.patch(
        ms_path(ns, name), {"spec": {"engine": {"kind": "sglang"}, "resources": {"gpus": 0}}}
    )
    ms = eventually(
        lambda: (
            (m := admin.get(ms_path(ns, name)))
            and condition_of(m, "Ready")["reason"] == "InvalidSpec"
            and m
        )
    )
    message = condition_of(ms, "Degraded")["message"]
    assert message.startswith("spec.resources.gpus: 0 with engine.kind sglang"), message
    assert engine_container()["name"] == "vllm"


def test_a_forbidden_lease_is_an_error_not_a_standby(
    cluster: Cluster, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    """The chart grants the Lease in the operator's own namespace only: pointed at another,
    the API server answers 403. That is no standby (no other operator will ever let it work):
    one error naming the namespace and the verb, and a non-zero exit after the bounded wait."""
    forbidden = OperatorProcess(
        operator_kubeconfig,
        tmp_path / "forbidden.log",
        "--lease-namespace=default",
        "--lease-forbidden-timeout=3",
    ).start()
    assert forbidden.process is not None
    try:
        code = forbidden.process.wait(timeout=60)
    finally:
        if forbidden.process.poll() is None:
            forbidden.stop()
    output = forbidden.output()
    assert code == 2, output
    refusal = "forbidden to get Lease default/tokenkeep-operator"
    # Logged when first refused, then once more as the reason it exits: not every 3 s.
    assert output.count(refusal) == 2, output
    assert "cannot lead: " + refusal in output
    assert 'in namespace "default"' in output or "in namespace 'default'" in output
    assert "standby" not in output
    assert "Traceback" not in output, output


def test_a_second_operator_stays_passive_until_the_first_stops(
    cluster: Cluster,
    admin: Api,
    ns: str,
    operator: OperatorProcess,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    """Runs last: it stops the module's operator."""
    standby = OperatorProcess(operator_kubeconfig, tmp_path / "standby.log").start()
    try:
        eventually(lambda: "standby: lease" in standby.output(), timeout=60)
        create_example(admin, ns, "modelserver-qwen3-8b.yaml")
        eventually(lambda: deployment(admin, ns, "qwen3-8b-engine"))
        assert "leading" not in standby.output()
        assert operator.stop() == 0
        eventually(lambda: "leading" in standby.output(), timeout=20)
        admin.patch(
            path("apps/v1", "deployments", ns, "qwen3-8b-engine"), {"spec": {"replicas": 5}}
        )
        eventually(
            lambda: deployment(admin, ns, "qwen3-8b-engine")["spec"]["replicas"] == 1, timeout=10
        )
    finally:
        assert standby.stop() == 0, standby.output()
    assert "Traceback" not in standby.output(), standby.output()
