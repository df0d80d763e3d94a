"""The fake API server keeps the behaviours the operator relies on (see its docstring)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.operator.conftest import REPO_ROOT, load_example
from tests.operator.fake_apiserver import FakeApiServer

CM = "/api/v1/namespaces/ns/configmaps"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture(scope="module")
def api() -> Iterator[httpx.Client]:
    server = FakeApiServer(sorted((REPO_ROOT / "crds").glob("*.yaml")))
    server.start()
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client
    server.stop()


def configmap(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}


def test_versions_conflicts_and_no_op_writes(api: httpx.Client) -> None:
    created = api.post(CM, json=configmap("a")).json()
    assert created["kind"] == "ConfigMap" and created["metadata"]["uid"]
    assert api.post(CM, json=configmap("a")).status_code == 409
    rv = created["metadata"]["resourceVersion"]
    same = api.patch(f"{CM}/a", json={"data": {"k": "v"}}, headers=MERGE).json()
    assert same["metadata"]["resourceVersion"] == rv
    changed = api.patch(f"{CM}/a", json={"data": {"k": "w"}}, headers=MERGE).json()
    assert int(changed["metadata"]["resourceVersion"]) > int(rv)
    stale = {"metadata": {"resourceVersion": rv}, "data": {"k": "x"}}
    assert api.patch(f"{CM}/a", json=stale, headers=MERGE).status_code == 409
    removed = api.patch(f"{CM}/a", json={"data": {"k": None}}, headers=MERGE).json()
    assert "k" not in removed["data"]


def test_patch_types(api: httpx.Client) -> None:
    api.post(CM, json=configmap("b"))
    ops = [{"op": "test", "path": "/data/k", "value": "nope"}, {"op": "remove", "path": "/data/k"}]
    json_patch = {"Content-Type": "application/json-patch+json"}
    assert api.patch(f"{CM}/b", json=ops, headers=json_patch).status_code == 422
    ops[0]["value"] = "v"
    assert api.patch(f"{CM}/b", json=ops, headers=json_patch).json()["data"] == {}
    strategic = {"Content-Type": "application/strategic-merge-patch+json"}
    assert api.patch(f"{CM}/b", json={}, headers=strategic).status_code == 415


def test_status_subresource_and_generation(api: httpx.Client) -> None:
    path = "/apis/tokenkeep.dev/v1alpha1/namespaces/ns/modelservers"
    resource = load_example("modelserver-qwen3-8b.yaml")
    resource["status"] = {"readyReplicas": 9}
    created = api.post(path, json=resource).json()
    assert "status" not in created  # status is not settable through the main endpoint
    assert created["spec"]["engine"]["gpuMemoryUtilization"] == 0.9  # CRD defaulting
    item = f"{path}/qwen3-8b"
    after_status = api.patch(f"{item}/status", json={"status": {"readyReplicas": 1}}, headers=MERGE)
    assert after_status.json()["metadata"]["generation"] == 1
    labelled = api.patch(item, json={"metadata": {"labels": {"a": "b"}}}, headers=MERGE).json()
    assert labelled["metadata"]["generation"] == 1
    scaled = api.patch(f"{item}/scale", json={"spec": {"replicas": 3}}, headers=MERGE).json()
    assert scaled["kind"] == "Scale" and scaled["spec"]["replicas"] == 3
    current = api.get(item).json()
    assert current["metadata"]["generation"] == 2 and current["status"]["readyReplicas"] == 1
    invalid = api.patch(item, json={"spec": {"engine": {"tensorParallelSize": 2}}}, headers=MERGE)
    assert invalid.status_code == 422
    assert "multiple of engine.tensorParallelSize" in invalid.json()["message"]


def test_watch_replays_changes_in_order_with_selectors(api: httpx.Client) -> None:
    start = api.get(CM).json()["metadata"]["resourceVersion"]
    api.post(CM, json=configmap("w1", team="x"))
    api.post(CM, json=configmap("w2", team="y"))
    api.patch(f"{CM}/w1", json={"data": {"k": "2"}}, headers=MERGE)
    api.delete(f"{CM}/w1")
    params = {
        "watch": "true",
        "resourceVersion": start,
        "labelSelector": "team=x",
        "timeoutSeconds": "1",
    }
    with api.stream("GET", CM, params=params) as response:
        events = [json.loads(line) for line in response.iter_lines() if line]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w1"),
        ("MODIFIED", "w1"),
        ("DELETED", "w1"),
    ]


def test_finalizers_and_cascading_garbage_collection(api: httpx.Client) -> None:
    owner = api.post(
        CM, json={**configmap("owner"), "metadata": {"name": "owner", "finalizers": ["x/y"]}}
    ).json()

    def owned(name: str, parent: dict[str, Any]) -> dict[str, Any]:
        ref = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": parent["metadata"]["name"],
            "uid": parent["metadata"]["uid"],
        }
        return api.post(CM, json={"metadata": {"name": name, "ownerReferences": [ref]}}).json()

    child = owned("child", owner)
    owned("grandchild", child)
    assert api.delete(f"{CM}/owner").status_code == 200
    assert "deletionTimestamp" in api.get(f"{CM}/owner").json()["metadata"]
    assert api.get(f"{CM}/child").status_code == 200  # the owner still exists
    api.patch(f"{CM}/owner", json={"metadata": {"finalizers": None}}, headers=MERGE)
    for name in ("owner", "child", "grandchild"):
        assert api.get(f"{CM}/{name}").status_code == 404, name
