"""A real node where pods run (the shared `start-node.sh`: kubelet, scheduler and kube-proxy on
containerd, with cluster DNS and a default StorageClass), the images `make images` builds
imported into it, and the chart installed with `helm install` as a user installs it: the
operator runs as a pod, as the chart's ServiceAccount, leader election on.

The chart is installed from a copy adapted to this v1.20 server (README of shared/k8s): no
`kubeVersion` floor, no CEL rules in the CRDs. What ships is not lowered.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
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
    run_script,
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


def running_nodes() -> list[str]:
    """The shared/k8s nodes already running on this machine, as 'kubelet PID (its root
    dir)': there can be one per machine (the bridge tk0, port 10250 on 10.244.0.1, the
    iptables KUBE-* chains), and a second start-node.sh fails in ways that do not say so."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not alive(int(proc.name)):
            continue
        with contextlib.suppress(OSError):
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if args[0].endswith("/kubelet") and "--hostname-override=tk-node" in args:
                root = next((a.split("=", 1)[1] for a in args if a.startswith("--root-dir=")), "?")
                found.append(f"kubelet {proc.name} ({root})")
    return found


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

    def ctr(self, *args: str) -> str:
        """containerd's own CLI on the node's socket (images as the kubelet sees them)."""
        done = subprocess.run(
            ["ctr", "--address", str(self.run_dir / "node/containerd/containerd.sock"),
             "-n", "k8s.io", *args],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, f"ctr {' '.join(args)}: {done.stderr}"
        return done.stdout

    def tag_image(self, ref: str, new_ref: str) -> None:
        """Put an imported image on the node under a second name (as importing it again under
        that name would). containerd keeps them normalized (`docker.io/...`), as the kubelet
        asks for them."""
        names = self.ctr("images", "ls", "-q").split()
        [source] = [n for n in names if n == ref or n.endswith(f"/{ref}")]
        self.ctr("images", "tag", source, source.removesuffix(ref) + new_ref)

    def helm(self, *args: str) -> str:
        done = subprocess.run(
            [str(helm_binary()), "--kubeconfig", str(self.cluster.kubeconfig), *args],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout


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


def recorded_pids(run_dir: Path) -> list[int]:
    """The processes start-cluster.sh and start-node.sh recorded (RUN_DIR/*.pid)."""
    pids = []
    for pid_file in run_dir.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pids.append(int(pid_file.read_text().strip()))
    return pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def mounts_under(path: Path) -> list[str]:
    with open("/proc/mounts") as mounts:
        found = [line.split()[1] for line in mounts]
    return sorted((m for m in found if m.startswith(f"{path}/")), reverse=True)


def stop_node(scripts: Path, cluster: Cluster, run_dir: Path) -> None:
    """Stop the node and the control plane, then make sure nothing of them is left: every
    recorded process gone (killed if it lingers), no mount under RUN_DIR, and the node's
    containerd store (the imported images, ~4 GiB) removed."""
    pids = recorded_pids(run_dir)
    subprocess.run([str(scripts / "stop-node.sh"), str(run_dir)], check=False, timeout=180)
    cluster.stop()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in filter(alive, pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for mount in mounts_under(run_dir):
        subprocess.run(["umount", "-l", mount], check=False)
    remove_kubelet_chains()
    left = [p for p in pids if alive(p)]
    assert not left, f"node processes still running after stop: {left}"
    assert not mounts_under(run_dir), mounts_under(run_dir)


def remove_kubelet_chains() -> None:
    """The iptables chains the kubelet makes (KUBE-FIREWALL drops marked packets and blocks
    outside traffic to 127.0.0.0/8) and kube-proxy's cleanup leaves: their jumps from the
    built-in chains, then the chains."""
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for table in ("filter", "nat", "mangle"):
            listed = subprocess.run(
                [tool, "-t", table, "-S"], capture_output=True, text=True, check=False
            ).stdout.splitlines()
            for rule in listed:
                words = shlex.split(rule)
                if words[:1] == ["-A"] and not words[1].startswith("KUBE-") and "KUBE-" in rule:
                    subprocess.run([tool, "-t", table, "-D", *words[1:]], check=False)
            chains = [r.split()[1] for r in listed if r.startswith("-N KUBE-")]
            for chain in chains:
                subprocess.run([tool, "-t", table, "-F", chain], check=False)
            for chain in chains:
                subprocess.run([tool, "-t", table, "-X", chain], check=False)


def build_images(timeout: float = 3600) -> None:
    """`make images` (images/build.py), its progress printed as it goes; if it fails, the
    error carries its last lines (CI keeps the report, not the progress)."""
    build = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "images" / "build.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(timeout, build.kill)
    watchdog.start()
    last: deque[str] = deque(maxlen=40)
    try:
        assert build.stdout is not None
        for line in build.stdout:
            print(line, end="", flush=True)
            last.append(line)
        code = build.wait()
    finally:
        watchdog.cancel()
    if code != 0:
        raise AssertionError(f"images/build.py exited {code}:\n{''.join(last)}")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """Module scope: in `make test` the node (and whatever a failed step left running on it)
    is stopped as soon as the tier ends, not at the end of the whole suite."""
    problem = missing_node_prerequisites()
    if problem:
        pytest.skip(problem)
    scripts = k8s_dir()
    assert scripts is not None
    others = running_nodes()
    assert not others, (
        f"a node already runs on this machine ({', '.join(others)}), and there can be one: "
        "let the run that started it finish, or stop it (shared/k8s/stop-node.sh RUN_DIR, "
        "then stop-cluster.sh RUN_DIR)"
    )
    run_dir = tmp_path_factory.mktemp("node")
    timings: dict[str, float] = {}
    cluster = Cluster(run_dir)
    started = time.monotonic()
    try:
        cluster.start()
        run_script(
            [str(scripts / "start-node.sh"), str(run_dir)],
            {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "NODE_SERVICES": "1"},
            300,
        )
        timings["node_start_s"] = time.monotonic() - started
        # Cached (dist/images/cache): after a first build this only checks hashes.
        started = time.monotonic()
        build_images()
        timings["images_s"] = time.monotonic() - started
        listed = json.loads((REPO_ROOT / "dist" / "images" / "images.json").read_text())
        started = time.monotonic()
        node = Node(cluster, run_dir, listed, timings)
        for image in listed.values():
            node.ctr("images", "import", image["archive"])
        timings["import_s"] = time.monotonic() - started
        yield node
    finally:
        print(f"cluster tier timings: {json.dumps(timings)}")
        stop_node(scripts, cluster, run_dir)


@pytest.fixture(scope="module")
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each test's call report on the item (`rep_call`), so a fixture can print what an admin
    would look at after a failed step."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)
