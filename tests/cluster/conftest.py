"""A real node where pods run (the shared `start-node.sh`: kubelet, scheduler and kube-proxy on
containerd, with cluster DNS and a default StorageClass), the images `make images` builds
imported into it, and the chart installed with `helm install` as a user installs it: the
operator runs as a pod, as the chart's ServiceAccount, leader election on.

The chart is installed from a copy adapted to this v1.20 server (README of shared/k8s): no
`kubeVersion` floor, no CEL rules in the CRDs. What ships is not lowered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.conftest import REPO_ROOT
from tests.operator.helm_binary import helm_binary
from tests.operator.real_cluster import (
    OPERATOR_NAMESPACE,
    RELEASE,
    Cluster,
    eventually,
    k8s_dir,
    missing_prerequisites,
    without_cel,
)

NODE_TOOLS = ("containerd", "runc", "socat", "iptables", "mmdebstrap", "gcc")


def missing_node_prerequisites() -> str | None:
    problem = missing_prerequisites()
    if problem:
        return problem
    if os.geteuid() != 0:
        return "the node needs root (bridge, iptables, containerd)"
    for tool in NODE_TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} not installed (make k8s-deps)"
    return None


@dataclass
class Node:
    cluster: Cluster
    run_dir: Path
    images: dict[str, dict[str, str]]
    timings: dict[str, float]

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        done = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.cluster.kubeconfig), *args],
            capture_output=True, text=True, input=input, timeout=300,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def helm(self, *args: str) -> str:
        done = subprocess.run(
            [str(helm_binary()), "--kubeconfig", str(self.cluster.kubeconfig), *args],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout


def import_image(run_dir: Path, archive: str) -> None:
    subprocess.run(
        ["ctr", "--address", str(run_dir / "node/containerd/containerd.sock"), "-n", "k8s.io",
         "images", "import", archive],
        check=True, capture_output=True, timeout=900,
    )  # fmt: skip


def adapted_chart(target: Path) -> Path:
    """The chart as shipped, less what v1.20 cannot take: the kubeVersion floor (>=1.32) and
    the CRDs' CEL rules (tests/operator/test_crds.py evaluates those)."""
    chart = target / "tokenkeep"
    shutil.copytree(REPO_ROOT / "charts" / "tokenkeep", chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    assert meta.pop("kubeVersion").startswith(">=1.32")
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    for crd in (chart / "crds").glob("*.yaml"):
        crd.write_text(yaml.safe_dump(without_cel(yaml.safe_load(crd.read_text()))))
    return chart


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    problem = missing_node_prerequisites()
    if problem:
        pytest.skip(problem)
    scripts = k8s_dir()
    assert scripts is not None
    run_dir = tmp_path_factory.mktemp("node")
    timings: dict[str, float] = {}
    cluster = Cluster(run_dir)
    started = time.monotonic()
    cluster.start()
    try:
        subprocess.run(
            [str(scripts / "start-node.sh"), str(run_dir)],
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "NODE_SERVICES": "1"},
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        timings["node_start_s"] = time.monotonic() - started
        # `make test` builds them first (make images); cached, so this only checks hashes.
        started = time.monotonic()
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "images" / "build.py")], check=True, timeout=3600
        )
        timings["images_s"] = time.monotonic() - started
        listed = json.loads((REPO_ROOT / "dist" / "images" / "images.json").read_text())
        started = time.monotonic()
        for image in listed.values():
            import_image(run_dir, image["archive"])
        timings["import_s"] = time.monotonic() - started
        yield Node(cluster, run_dir, listed, timings)
    finally:
        subprocess.run([str(scripts / "stop-node.sh"), str(run_dir)], check=False, timeout=120)
        cluster.stop()


@pytest.fixture(scope="session")
def release(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`helm install` with dist/images/values-local.yaml; yields the chart copy."""
    chart = adapted_chart(tmp_path_factory.mktemp("chart"))
    values = REPO_ROOT / "dist" / "images" / "values-local.yaml"
    started = time.monotonic()
    node.helm(
        "install", RELEASE, str(chart), "-n", OPERATOR_NAMESPACE, "--create-namespace",
        "-f", str(values), "--wait", "--timeout", "5m",
    )  # fmt: skip
    node.timings["operator_ready_s"] = time.monotonic() - started
    yield chart
    # The test uninstalls it itself; this only cleans up after a failure.
    subprocess.run(
        [str(helm_binary()), "--kubeconfig", str(node.cluster.kubeconfig), "uninstall", RELEASE,
         "-n", OPERATOR_NAMESPACE],
        capture_output=True, check=False, timeout=300,
    )  # fmt: skip


def wait_for(check: Any, timeout: float, interval: float = 2.0) -> Any:
    return eventually(check, timeout=timeout, interval=interval)
