"""The Helm chart, rendered by the real helm binary and checked like an API server would."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.conftest import REPO_ROOT
from tests.operator.helm_binary import helm_binary
from tests.operator.schemas import custom_resource_errors, validate_builtin
from tokenkeep_operator.cli import build_parser

CHART = REPO_ROOT / "charts" / "tokenkeep"
VALUES = sorted((Path(__file__).parent / "chart_values").glob("*.yaml"))
NAMESPACE = "tokenkeep-system"


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, check=False)


def render(helm: Path, values: Path, *extra: str) -> list[dict[str, Any]]:
    result = run_helm(
        helm, "template", "tk", str(CHART), "-n", NAMESPACE, "-f", str(values), *extra
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def crds() -> dict[str, dict[str, Any]]:
    loaded = [yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*.yaml")]
    return {crd["spec"]["names"]["kind"]: crd for crd in loaded}


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.stem)
def test_helm_lint_strict(helm: Path, values: Path) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.stem)
def test_every_rendered_object_is_valid(helm: Path, values: Path) -> None:
    documents = render(helm, values, "--include-crds")
    definitions = crds()
    kinds = set()
    for doc in documents:
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("tokenkeep.dev/"):
            assert custom_resource_errors(definitions[doc["kind"]], doc) == []
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # no schema offline; tests/operator/test_chart_observability.py checks it
        else:
            validate_builtin(doc)
    assert {"Deployment", "CustomResourceDefinition"} <= kinds


def test_values_schema_rejects_mistakes(helm: Path, tmp_path: Path) -> None:
    for bad in (
        "operator:\n  watchNamespaces: all\n",
        "example:\n  enabled: true\n  modelServer: {name: m, uri: 's3://x', gpus: 1}\n",
        "operatr:\n  debug: true\n",
    ):
        values = tmp_path / "bad.yaml"
        values.write_text(bad)
        result = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values))
        assert result.returncode != 0, bad


def _operator_container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.stem)
def test_operator_command_line_is_one_the_cli_accepts(helm: Path, values: Path) -> None:
    container = _operator_container(render(helm, values))
    assert container["command"] == ["tokenkeep", "operator"]
    args = build_parser().parse_args(container["args"])
    assert args.liveness.endswith(":8080/healthz")
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
    image = next(e for e in container["env"] if e["name"] == "TOKENKEEP_IMAGE")["value"]
    assert image == container["image"]


def test_namespaced_install_gets_roles_not_cluster_write_access(helm: Path) -> None:
    documents = render(helm, Path(__file__).parent / "chart_values" / "namespaced.yaml")
    roles = [d for d in documents if d["kind"] == "Role"]
    watched = [
        r["metadata"]["namespace"] for r in roles if "leader-election" not in r["metadata"]["name"]
    ]
    assert sorted(watched) == ["rl-team-a", "rl-team-b"]
    args = _operator_container(documents)["args"]
    assert build_parser().parse_args(args).namespace == ["rl-team-a", "rl-team-b"]
    for cluster_role in (d for d in documents if d["kind"] == "ClusterRole"):
        for rule in cluster_role["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.stem)
def test_rbac_is_least_privilege(helm: Path, values: Path) -> None:
    rules = [
        rule
        for doc in render(helm, values)
        if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"]
    ]
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        if "secrets" in rule["resources"]:
            # The generated admin and engine keys: create; get one admin key by name (for
            # GET /policy). Never list or watch: no sweep of every Secret.
            assert rule["resources"] == ["secrets"], rule
            assert rule["verbs"] in (["create"], ["create", "get"]), rule
        assert "deletecollection" not in rule["verbs"], rule
        if "update" in rule["verbs"]:
            # Finalizers (for blockOwnerDeletion) and the leader-election Lease only.
            assert set(rule["resources"]) <= {
                "modelservers/finalizers",
                "sessionservers/finalizers",
                "leases",
            }, rule
        if "delete" in rule["verbs"]:
            # Only what the operator owns (to set or drop an owner reference under
            # OwnerReferencesPermissionEnforcement); never the custom resources or pods.
            assert not {"modelservers", "sessionservers", "pods"} & set(rule["resources"]), rule
        if "pods" in rule["resources"]:
            assert set(rule["verbs"]) == {"get", "list", "watch"}


def _secret_verbs(documents: list[dict[str, Any]]) -> set[str]:
    return {
        verb
        for doc in documents
        if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"]
        if "secrets" in rule["resources"]
        for verb in rule["verbs"]
    }


def test_reading_admin_keys_for_the_policy_status_can_be_turned_off(
    helm: Path, tmp_path: Path
) -> None:
    """By default the operator may get a Secret by name (a SessionServer's admin key, for
    status.policy); `rbac.readAdminKeys: false` leaves it create-only, as before."""
    default = Path(__file__).parent / "chart_values" / "namespaced.yaml"
    assert _secret_verbs(render(helm, default)) == {"create", "get"}
    off = tmp_path / "off.yaml"
    off.write_text("rbac:\n  readAdminKeys: false\n")
    assert _secret_verbs(render(helm, default, "-f", str(off))) == {"create"}


def test_rbac_covers_every_kind_the_operator_writes(helm: Path) -> None:
    """Every child kind the builders render can be created and patched."""
    from tests.operator.test_manifests import SCENARIOS

    documents = render(helm, VALUES[0])
    allowed = {
        (group, resource, verb)
        for doc in documents
        if doc["kind"] == "ClusterRole"
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    from tokenkeep_operator.kube import PLURALS

    for scenario in SCENARIOS.values():
        for obj in scenario():
            group = obj["apiVersion"].rpartition("/")[0]
            for verb in ("get", "list", "watch", "create", "patch", "delete"):
                assert (group, PLURALS[obj["kind"]], verb) in allowed, (obj["kind"], verb)
    for kind in ("modelservers", "sessionservers"):
        assert ("tokenkeep.dev", f"{kind}/status", "patch") in allowed
        assert ("tokenkeep.dev", f"{kind}/finalizers", "update") in allowed


def test_example_stack_matches_the_crds_and_points_the_session_server_at_the_model(
    helm: Path,
) -> None:
    documents = render(helm, Path(__file__).parent / "chart_values" / "example-stack.yaml")
    model = next(d for d in documents if d["kind"] == "ModelServer")
    sessions = next(d for d in documents if d["kind"] == "SessionServer")
    assert sessions["spec"]["modelServerRef"]["name"] == model["metadata"]["name"] == "qwen3-4b"
    assert model["metadata"]["namespace"] == sessions["metadata"]["namespace"] == NAMESPACE


def test_image_user_matches_what_pods_run_as(helm: Path) -> None:
    """runAsNonRoot needs a numeric USER in the image, equal to the pods' runAsUser."""
    from tokenkeep_operator.manifests.session import TOKENKEEP_UID

    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert f"USER {TOKENKEEP_UID}:{TOKENKEEP_UID}" in dockerfile
    deployment = next(d for d in render(helm, VALUES[0]) if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == TOKENKEEP_UID
