"""A real Kubernetes control plane for the operator tests, and the operator run as the chart
installs it.

`start-cluster.sh` (from the shared `k8s/` folder: kube-apiserver and kube-controller-manager
v1.20.2 with Debian's etcd, on free loopback ports) is started once per test session with
`OwnerReferencesPermissionEnforcement` on, as OpenShift has it. The CRDs are installed from
`crds/` (CEL rules removed: 1.20 predates them; `test_crds.py` evaluates them instead), the
chart's ServiceAccount and RBAC from `helm template`, and the operator runs as
`tokenkeep operator` in a subprocess with that ServiceAccount's token, so every request it
makes is authorised exactly as in a cluster.

No kubelet and no scheduler run: pods stay Pending unless a test writes their status.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from session_server.devtools.shared import shared_k8s_dir
from tests.operator.conftest import REPO_ROOT
from tests.operator.helm_binary import helm_binary

OPERATOR_NAMESPACE = "tokenkeep-system"
RELEASE = "tk"
ADMISSION_PLUGINS = (
    "NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultStorageClass,ResourceQuota,"
    "OwnerReferencesPermissionEnforcement"
)
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
MERGE = "application/merge-patch+json"


def run_script(args: list[str], env: dict[str, str], timeout: float) -> None:
    """Run one of shared/k8s's scripts; if it fails, the error carries what it printed (a
    CalledProcessError would say only its exit status, and CI keeps only the report)."""
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{output}")


def k8s_dir() -> Path | None:
    """The shared folder with the Kubernetes binaries: `$TOKENKEEP_K8S_DIR`, else the nearest
    `shared/k8s` (`session_server.devtools.shared`)."""
    found = shared_k8s_dir(os.environ.get("TOKENKEEP_K8S_DIR"))
    return found if found is not None and (found / "start-cluster.sh").is_file() else None


def missing_prerequisites() -> str | None:
    if k8s_dir() is None:
        return "no shared/k8s folder with start-cluster.sh (set TOKENKEEP_K8S_DIR)"
    for tool in ("etcd", "kubectl", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (make k8s-deps)"
    return None


def eventually(check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2) -> Any:
    """Poll until `check` returns something truthy without raising; return it."""
    deadline = time.monotonic() + timeout
    failure: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
            failure = None
        except (AssertionError, KeyError, IndexError, StopIteration, TypeError) as error:
            failure = error
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s; last failure: {failure!r}")
        time.sleep(interval)


def path(api_version: str, plural: str, namespace: str | None = None, name: str = "") -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{scope}/{plural}" + (f"/{name}" if name else "")


def ms_path(namespace: str, name: str = "") -> str:
    return path("tokenkeep.dev/v1alpha1", "modelservers", namespace, name)


def ss_path(namespace: str, name: str = "") -> str:
    return path("tokenkeep.dev/v1alpha1", "sessionservers", namespace, name)


class Api:
    """Plain REST calls as one user (a bearer token), returning dicts."""

    def __init__(self, server: str, token: str, ca: Path) -> None:
        self.client = httpx.Client(
            base_url=server,
            headers={"Authorization": f"Bearer {token}"},
            verify=str(ca),
            timeout=15,
        )

    def get(self, url: str, **params: str) -> dict[str, Any] | None:
        response = self.client.get(url, params=params)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def items(self, url: str, **params: str) -> list[dict[str, Any]]:
        found = self.get(url, **params)
        return list((found or {}).get("items") or [])

    def create(self, url: str, obj: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(url, json=obj)
        assert response.status_code in (200, 201), response.text
        return response.json()

    def patch(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.patch(url, json=body, headers={"Content-Type": MERGE})
        assert response.status_code == 200, response.text
        return response.json()

    def delete(self, url: str) -> None:
        response = self.client.delete(url)
        assert response.status_code in (200, 202, 404), response.text

    def table(self, url: str) -> dict[str, Any]:
        """What `kubectl get` prints: the server-side table with the printer columns."""
        accept = "application/json;as=Table;v=v1;g=meta.k8s.io"
        response = self.client.get(url, headers={"Accept": accept})
        response.raise_for_status()
        return response.json()

    def namespace(self, name: str) -> str:
        self.create("/api/v1/namespaces", {"metadata": {"name": name}})
        # The service-account controller makes `default` in every namespace; pods need it.
        eventually(lambda: self.get(path("v1", "serviceaccounts", name, "default")))
        return name


def without_cel(document: Any) -> Any:
    if isinstance(document, dict):
        return {k: without_cel(v) for k, v in document.items() if k != "x-kubernetes-validations"}
    if isinstance(document, list):
        return [without_cel(v) for v in document]
    return document


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie that nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Cluster:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.scripts = k8s_dir()
        assert self.scripts is not None
        self.kubeconfig = run_dir / "kubeconfig"

    def start(self) -> None:
        env = {**os.environ, "ADMISSION_PLUGINS": ADMISSION_PLUGINS}
        run_script([str(self.scripts / "start-cluster.sh"), str(self.run_dir)], env, 180)
        config = yaml.safe_load(self.kubeconfig.read_text())
        self.server = config["clusters"][0]["cluster"]["server"]
        self.ca = Path(config["clusters"][0]["cluster"]["certificate-authority"])
        self.admin = Api(self.server, config["users"][0]["user"]["token"], self.ca)

    def stop(self) -> None:
        subprocess.run([str(self.scripts / "stop-cluster.sh"), str(self.run_dir)], check=False)

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again with the same command line (etcd, and so
        every object, stays)."""
        pid_file = self.run_dir / "apiserver.pid"
        pid = int(pid_file.read_text())
        command = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        os.kill(pid, signal.SIGTERM)
        try:
            eventually(lambda: not _alive(pid), timeout=10)
        except AssertionError:
            os.kill(pid, signal.SIGKILL)  # as stop-cluster.sh does
            eventually(lambda: not _alive(pid), timeout=10)
        log = (self.run_dir / "apiserver.log").open("ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        pid_file.write_text(str(process.pid))
        eventually(self._ready, timeout=90, interval=1)

    def _ready(self) -> bool:
        try:
            return self.admin.client.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def kubectl(self, *args: str) -> str:
        return subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def kubectl_apply(self, documents: list[dict[str, Any]]) -> None:
        text = yaml.safe_dump_all(documents)
        subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), "apply", "-f", "-"],
            input=text,
            text=True,
            check=True,
            capture_output=True,
        )

    def install_crds(self) -> None:
        crds = [
            without_cel(yaml.safe_load(p.read_text())) for p in (REPO_ROOT / "crds").glob("*.yaml")
        ]
        self.kubectl_apply(crds)
        for crd in crds:
            name = crd["metadata"]["name"]
            url = path("apiextensions.k8s.io/v1", "customresourcedefinitions", None, name)
            eventually(
                lambda url=url: any(
                    c["type"] == "Established" and c["status"] == "True"
                    for c in (self.admin.get(url) or {}).get("status", {}).get("conditions", [])
                )
            )

    def install_chart_rbac(self, *values: str) -> str:
        """The chart's ServiceAccount, (Cluster)Roles and bindings; returns the account's token."""
        self.admin.namespace(OPERATOR_NAMESPACE)
        sets = [a for v in values for a in ("--set", v)]
        rendered = subprocess.run(
            [
                str(helm_binary()),
                "template",
                RELEASE,
                str(REPO_ROOT / "charts" / "tokenkeep"),
                "-n",
                OPERATOR_NAMESPACE,
                *sets,
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        documents = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in RBAC_KINDS]
        for doc in documents:
            if doc["kind"] in {"ServiceAccount", "Role", "RoleBinding"}:
                doc["metadata"].setdefault("namespace", OPERATOR_NAMESPACE)
        self.kubectl_apply(documents)
        account = next(d for d in documents if d["kind"] == "ServiceAccount")["metadata"]["name"]
        # 1.20's token controller writes a token Secret for every ServiceAccount.
        secret = eventually(
            lambda: self.admin.get(path("v1", "serviceaccounts", OPERATOR_NAMESPACE, account))[
                "secrets"
            ][0]["name"]
        )
        data = self.admin.get(path("v1", "secrets", OPERATOR_NAMESPACE, secret))["data"]
        return base64.b64decode(data["token"]).decode()

    def user_kubeconfig(self, token: str, target: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca)},
                }
            ],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "operator"}}],
            "current-context": "local",
        }
        target.write_text(json.dumps(config))
        return target

    def write_count(self, resources: set[str]) -> int:
        """Writes (POST, PUT, PATCH, DELETE) the API server has answered for these resources
        (`resource` or `resource/subresource`), from its own request metrics."""
        response = self.admin.client.get("/metrics")
        response.raise_for_status()
        total = 0
        for line in response.text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            labels = {k: v.strip('"') for k, v in labels.items()}
            name = labels.get("resource", "")
            if labels.get("subresource"):
                name += "/" + labels["subresource"]
            if labels.get("verb") in {"POST", "PUT", "PATCH", "DELETE"} and name in resources:
                total += int(float(line.rsplit(" ", 1)[1]))
        return total


class OperatorProcess:
    """`tokenkeep operator` as the chart runs it, as the chart's ServiceAccount."""

    def __init__(self, kubeconfig: Path, log: Path, *extra: str) -> None:
        self.log_path = log
        self.args = [
            str(Path(sys.executable).parent / "tokenkeep"),
            "operator",
            "--all-namespaces",
            f"--lease-namespace={OPERATOR_NAMESPACE}",
            # Short, so that taking over from a killed operator takes seconds, not 15.
            "--lease-duration=4",
            *extra,
        ]
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "TOKENKEEP_IMAGE": "registry.example/tokenkeep:e2e",
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
