"""The shared k8s folder is found from a checkout cloned anywhere (CI's fresh clone)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from session_server.devtools.shared import shared_k8s_dir


def _git(*args: str) -> None:
    subprocess.run(["git", *args], check=True, capture_output=True)


def test_a_clone_outside_the_workspace_finds_the_shared_folder_of_its_origin(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "work"
    k8s = workspace / "shared" / "k8s"
    k8s.mkdir(parents=True)
    (k8s / "start-cluster.sh").write_text("#!/bin/sh\n")
    main = workspace / "main"
    main.mkdir()
    _git("-C", str(main), "init", "-q")
    _git("-C", str(main), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
         "--allow-empty", "-m", "start")  # fmt: skip
    clone = tmp_path / "elsewhere" / "clone"
    _git("clone", "-q", str(main), str(clone))

    assert shared_k8s_dir(repo=main) == k8s  # beside the checkout
    assert shared_k8s_dir(repo=clone) == k8s.resolve()  # through the clone's origin
    assert shared_k8s_dir("/explicit/k8s", repo=clone) == Path("/explicit/k8s")
    (k8s / "start-cluster.sh").unlink()
    assert shared_k8s_dir(repo=clone) is None
