"""The operator end to end: Kopf with tokenkeep's handlers against the fake API server.

The fake server has no controllers, so these tests play the Deployment controller, the
scheduler and the kubelet themselves: they create pods and write Deployment/StatefulSet
status, exactly the objects the operator watches on a real cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kopf.testing import KopfRunner

from tests.operator.conftest import REPO_ROOT, load_example
from tests.operator.fake_apiserver import FakeApiServer

NS = "rl"
CR = f"/apis/tokenkeep.dev/v1alpha1/namespaces/{NS}"
APPS = f"/apis/apps/v1/namespaces/{NS}"
CORE = f"/api/v1/namespaces/{NS}"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
def apiserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    server = FakeApiServer(sorted((REPO_ROOT / "crds").glob("*.yaml")))
    server.start()
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setenv("TOKENKEEP_IMAGE", "registry.example/tokenkeep:e2e")
    yield server
    server.stop()


@pytest.fixture
def api(apiserver: FakeApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=apiserver.url, timeout=10) as client:
        yield client


@pytest.fixture
def operator(apiserver: FakeApiServer) -> Iterator[KopfRunner]:
    args = ["run", "--standalone", "--all-namespaces", "-m", "tokenkeep_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert "Traceback" not in runner.output, runner.output


def eventually(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll until `check` returns something truthy without raising; return it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
            failure: Exception | None = None
        except (AssertionError, KeyError, StopIteration, TypeError) as error:
            failure = error
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; last failure: {failure!r}")
        time.sleep(0.1)


def get(api: httpx.Client, path: str) -> dict[str, Any] | None:
    response = api.get(path)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return response.json()


def create(api: httpx.Client, path: str, obj: dict[str, Any]) -> dict[str, Any]:
    response = api.post(path, json=obj)
    assert response.status_code == 201, response.text
    return response.json()


def patch(api: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = api.patch(path, json=body, headers=MERGE)
    assert response.status_code == 200, response.text
    return response.json()


def conditions(obj: dict[str, Any] | None) -> dict[str, tuple[str, str]]:
    assert obj is not None
    return {
        c["type"]: (c["status"], c["reason"]) for c in obj.get("status", {}).get("conditions", [])
    }


def condition_is(api: httpx.Client, path: str, type_: str, status: str, reason: str) -> bool:
    obj = get(api, path)
    return conditions(obj).get(type_) == (status, reason)


def pod(deployment: dict[str, Any], name: str, status: dict[str, Any]) -> dict[str, Any]:
    """A pod as the ReplicaSet would create it (owned through the Deployment here)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": deployment["spec"]["template"]["metadata"]["labels"],
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": deployment["kind"],
                    "name": deployment["metadata"]["name"],
                    "uid": deployment["metadata"]["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": deployment["spec"]["template"]["spec"],
        "status": status,
    }


def running(started: bool) -> dict[str, Any]:
    return {
        "phase": "Running",
        "containerStatuses": [
            {"name": "main", "ready": started, "started": started, "state": {"running": {}}}
        ],
    }


def add_pod(api: httpx.Client, deployment: dict[str, Any], name: str, status: dict) -> None:
    create(api, f"{CORE}/pods", pod(deployment, name, status))
    # Like the kubelet: status goes through the status subresource.
    patch(api, f"{CORE}/pods/{name}/status", {"status": status})


def roll_out(api: httpx.Client, path: str, ready: int) -> None:
    """Report a finished rollout with `ready` ready replicas, as the controller would."""
    controller = get(api, path)
    assert controller is not None
    replicas = controller["spec"]["replicas"]
    status = {
        "observedGeneration": controller["metadata"]["generation"],
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": ready,
        "availableReplicas": ready,
    }
    patch(api, f"{path}/status", {"status": status})


def events_for(api: httpx.Client, name: str) -> list[tuple[str, str]]:
    items = api.get(f"{CORE}/events").json()["items"]
    return [(e["type"], e["reason"]) for e in items if e["involvedObject"]["name"] == name]


def test_modelserver_lifecycle(api: httpx.Client, operator: KopfRunner) -> None:
    model_server = create(api, f"{CR}/modelservers", load_example("modelserver-qwen3-8b.yaml"))
    uid = model_server["metadata"]["uid"]
    ms_path = f"{CR}/modelservers/qwen3-8b"
    dep_path = f"{APPS}/deployments/qwen3-8b-engine"

    # Children appear, owned by the ModelServer.
    deployment = eventually(lambda: get(api, dep_path))
    for path in (
        f"{CORE}/services/qwen3-8b-engine",
        f"{CORE}/services/qwen3-8b-engine-pods",
        f"{CORE}/persistentvolumeclaims/qwen3-8b-model-cache",
        f"{CORE}/serviceaccounts/qwen3-8b-engine",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/qwen3-8b-engine",
        dep_path,
    ):
        child = eventually(lambda path=path: get(api, path))
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid, path

    # Status is filled in from the start.
    status = eventually(lambda: (get(api, ms_path) or {}).get("status", {}).get("conditions"))
    ms = get(api, ms_path)
    assert ms["status"]["observedGeneration"] == 1
    assert ms["status"]["url"] == f"http://qwen3-8b-engine.{NS}.svc:8000"
    assert "app.kubernetes.io/instance=qwen3-8b" in ms["status"]["selector"]
    assert status
    # No finalizer: deleting a ModelServer never waits for the operator to be running.
    assert not ms["metadata"].get("finalizers")

    # A replica loading the model...
    add_pod(api, deployment, "qwen3-8b-engine-a", running(started=False))
    eventually(lambda: condition_is(api, ms_path, "Ready", "False", "LoadingModel"))
    assert conditions(get(api, ms_path))["Progressing"] == ("True", "LoadingModel")

    # ...then ready: the status follows the Deployment.
    patch(api, f"{CORE}/pods/qwen3-8b-engine-a/status", {"status": running(started=True)})
    roll_out(api, dep_path, ready=1)
    eventually(lambda: condition_is(api, ms_path, "Ready", "True", "Available"))
    assert conditions(get(api, ms_path)) == {
        "Ready": ("True", "Available"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert get(api, ms_path)["status"]["readyReplicas"] == 1
    assert ("Normal", "Available") in eventually(lambda: events_for(api, "qwen3-8b"))

    # A spec update patches the Deployment in place.
    patch(api, ms_path, {"spec": {"engine": {"maxModelLen": 16384}}})

    def args_updated() -> bool:
        container = get(api, dep_path)["spec"]["template"]["spec"]["containers"][0]
        return container["args"][container["args"].index("--max-model-len") + 1] == "16384"

    eventually(args_updated)
    eventually(lambda: get(api, ms_path)["status"]["observedGeneration"] == 2)
    assert get(api, dep_path)["metadata"]["uid"] == deployment["metadata"]["uid"]

    # An autoscaler scales through the scale subresource; the operator follows it.
    response = api.patch(f"{ms_path}/scale", json={"spec": {"replicas": 2}}, headers=MERGE)
    assert response.status_code == 200, response.text
    eventually(lambda: get(api, dep_path)["spec"]["replicas"] == 2)
    assert get(api, ms_path)["spec"]["replicas"] == 2
    assert api.get(f"{ms_path}/scale").json()["spec"]["replicas"] == 2

    # The second replica cannot be scheduled: no GPU left.
    roll_out(api, dep_path, ready=1)
    unschedulable = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    add_pod(api, get(api, dep_path), "qwen3-8b-engine-b", unschedulable)
    eventually(lambda: condition_is(api, ms_path, "Degraded", "True", "InsufficientGPU"))
    assert conditions(get(api, ms_path))["Ready"] == ("False", "InsufficientGPU")
    assert ("Warning", "InsufficientGPU") in eventually(lambda: events_for(api, "qwen3-8b"))

    # Deleting the ModelServer collects every child (and the pods, through the Deployment).
    assert api.delete(ms_path).status_code == 200
    eventually(lambda: get(api, dep_path) is None)
    assert get(api, f"{CORE}/persistentvolumeclaims/qwen3-8b-model-cache") is None
    assert get(api, f"{CORE}/services/qwen3-8b-engine-pods") is None
    assert api.get(f"{CORE}/pods").json()["items"] == []


def test_sessionserver_follows_its_modelserver(api: httpx.Client, operator: KopfRunner) -> None:
    ss_path = f"{CR}/sessionservers/rollouts"
    create(api, f"{CR}/sessionservers", load_example("sessionserver.yaml"))

    # No ModelServer yet: a clear reason, no children, no crash.
    eventually(lambda: condition_is(api, ss_path, "Degraded", "True", "ModelServerNotFound"))
    assert get(api, f"{APPS}/deployments/rollouts-sessions") is None

    # The ModelServer appears: the SessionServer is rendered against it.
    create(api, f"{CR}/modelservers", load_example("modelserver-qwen3-8b.yaml"))
    deployment = eventually(lambda: get(api, f"{APPS}/deployments/rollouts-sessions"))
    config = get(api, f"{CORE}/configmaps/rollouts-sessions-config")
    assert config["data"]["TOKENKEEP_ENGINE_URLS"] == f"http://qwen3-8b-engine-pods.{NS}.svc:8000"
    assert config["data"]["TOKENKEEP_REDIS_URL"].startswith("redis://rollouts-redis-0.")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/tokenkeep:e2e"
    redis_path = f"{APPS}/statefulsets/rollouts-redis"
    assert eventually(lambda: get(api, redis_path))

    ss = eventually(
        lambda: (
            get(api, ss_path)
            if conditions(get(api, ss_path)).get("Ready") == ("False", "RedisNotReady")
            else None
        )
    )
    assert ss["status"]["sessionUrlTemplate"] == (
        f"http://rollouts-sessions.{NS}.svc:8000/sessions/{{session_id}}/v1"
    )

    # Redis up; the model is still loading, which is now the reason.
    roll_out(api, redis_path, ready=1)
    eventually(lambda: condition_is(api, ss_path, "Ready", "False", "ModelServerNotReady"))

    # A session server pod cannot start: its API key secret is missing.
    missing = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "session-server",
                "ready": False,
                "state": {
                    "waiting": {
                        "reason": "CreateContainerConfigError",
                        "message": 'secret "tokenkeep-api-key" not found',
                    }
                },
            }
        ],
    }
    add_pod(api, deployment, "rollouts-sessions-a", missing)
    eventually(lambda: condition_is(api, ss_path, "Degraded", "True", "SecretNotFound"))
    message = next(
        c["message"] for c in get(api, ss_path)["status"]["conditions"] if c["type"] == "Degraded"
    )
    assert "tokenkeep-api-key" in message

    # The user creates the secret; the pod starts, engine and session server become ready.
    patch(api, f"{CORE}/pods/rollouts-sessions-a/status", {"status": running(started=True)})
    eventually(lambda: get(api, f"{APPS}/deployments/qwen3-8b-engine"))
    roll_out(api, f"{APPS}/deployments/qwen3-8b-engine", ready=1)
    roll_out(api, f"{APPS}/deployments/rollouts-sessions", ready=1)
    # The example asks for 2 replicas; one is ready, and nothing is wrong.
    eventually(lambda: condition_is(api, ss_path, "Ready", "False", "Starting"))
    assert conditions(get(api, ss_path))["Degraded"] == ("False", "AsExpected")
    patch(api, f"{CR}/sessionservers/rollouts", {"spec": {"replicas": 1}})
    eventually(lambda: get(api, f"{APPS}/deployments/rollouts-sessions")["spec"]["replicas"] == 1)
    roll_out(api, f"{APPS}/deployments/rollouts-sessions", ready=1)
    eventually(lambda: condition_is(api, ss_path, "Ready", "True", "Available"))
    assert conditions(get(api, ss_path))["Degraded"] == ("False", "AsExpected")


def test_bad_specs_are_reported_not_retried_hot(
    api: httpx.Client, apiserver: FakeApiServer, operator: KopfRunner
) -> None:
    # The API server itself refuses what the CRD's CEL rules forbid.
    bad = load_example("modelserver-qwen3-8b.yaml")
    bad["spec"]["resources"]["gpus"] = 3
    bad["spec"]["engine"]["tensorParallelSize"] = 2
    response = api.post(f"{CR}/modelservers", json=bad)
    assert response.status_code == 422
    assert "multiple of engine.tensorParallelSize" in response.json()["message"]

    # What only the operator can know: a pvc:// model gives no tokenizer to default to.
    local = {
        "apiVersion": "tokenkeep.dev/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "local"},
        "spec": {"model": {"uri": "pvc://weights/qwen3-8b"}},
    }
    create(api, f"{CR}/modelservers", local)
    sessions = load_example("sessionserver.yaml")
    sessions["spec"]["modelServerRef"]["name"] = "local"
    create(api, f"{CR}/sessionservers", sessions)
    ss_path = f"{CR}/sessionservers/rollouts"
    eventually(lambda: condition_is(api, ss_path, "Degraded", "True", "InvalidSpec"))
    status = get(api, ss_path)["status"]
    assert "spec.tokenizer is required" in status["conditions"][0]["message"]
    assert status["observedGeneration"] == 1

    # Reported once, not retried in a loop.
    time.sleep(2)
    patches = [
        r for r in apiserver.requests if r[0] == "PATCH" and "sessionservers/rollouts" in r[1]
    ]
    assert len(patches) < 10, patches
    assert get(api, f"{APPS}/deployments/rollouts-sessions") is None

    # Fixing the spec clears the condition and renders the children.
    patch(api, ss_path, {"spec": {"tokenizer": "Qwen/Qwen3-8B"}})
    eventually(lambda: get(api, f"{APPS}/deployments/rollouts-sessions"))
    eventually(lambda: conditions(get(api, ss_path))["Degraded"][1] != "InvalidSpec")
    assert get(api, ss_path)["status"]["observedGeneration"] == 2


def test_sessionserver_gets_a_generated_admin_key(api: httpx.Client, operator: KopfRunner) -> None:
    """Without apiKeySecretRef the operator creates `<name>-admin-key` once (the server
    refuses to listen on 0.0.0.0 without one) and never rewrites it on later reconciles."""
    create(api, f"{CR}/modelservers", load_example("modelserver-qwen3-8b.yaml"))
    body = load_example("sessionserver.yaml")
    del body["spec"]["apiKeySecretRef"]
    create(api, f"{CR}/sessionservers", body)
    secret_path = f"{CORE}/secrets/rollouts-admin-key"
    secret = eventually(lambda: get(api, secret_path))
    key = secret.get("stringData", secret.get("data", {}))["admin-key"]
    assert len(key) >= 40
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "SessionServer"
    deployment = eventually(lambda: get(api, f"{APPS}/deployments/rollouts-sessions"))
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    admin = next(e for e in env if e["name"] == "TOKENKEEP_ADMIN_KEY")
    assert admin["valueFrom"]["secretKeyRef"] == {"name": "rollouts-admin-key", "key": "admin-key"}

    patch(api, f"{CR}/sessionservers/rollouts", {"spec": {"replicas": 1}})
    eventually(lambda: get(api, f"{APPS}/deployments/rollouts-sessions")["spec"]["replicas"] == 1)
    again = get(api, secret_path)
    assert again is not None
    assert again.get("stringData", again.get("data", {}))["admin-key"] == key
