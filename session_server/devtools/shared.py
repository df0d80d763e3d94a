"""The machine's shared folder (`shared/k8s`: the Kubernetes binaries, `mkimage.py`), found
from a checkout wherever it lies.

Looked for beside the checkout and each of its parents, then, for a clone of a local
checkout (a fresh `git clone /work/main $(mktemp -d)`, as CI makes), beside the checkout it
was cloned from and each of its parents.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def shared_k8s_dir(explicit: str | None = None, repo: Path = REPO) -> Path | None:
    """`explicit` if given, else the nearest `shared/k8s` holding `start-cluster.sh`."""
    if explicit:
        return Path(explicit)
    roots = [repo, *_cloned_from(repo)]
    for root in roots:
        for folder in (root, *root.parents):
            candidate = folder / "shared" / "k8s"
            if (candidate / "start-cluster.sh").is_file():
                return candidate
    return None


def _cloned_from(repo: Path) -> list[Path]:
    try:
        url = subprocess.run(
            ["git", "-C", str(repo), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:  # no git
        return []
    origin = Path(url.removeprefix("file://"))
    return [origin.resolve()] if url and origin.is_dir() else []
