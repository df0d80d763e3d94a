"""Trainer frameworks installed as their released packages into their own virtualenvs under
`.cache/harnesses/` (once; reused after), never into tokenkeep's: they pull torch, Ray and pins
that tokenkeep must not depend on. verl, AReaL and NeMo Gym go in with `--no-deps` beside the
few packages their imported modules need (their full dependency sets are gigabytes of GPU
stack: verl's alone took 5 min and 1.9 GB here), pinned to what was tested; TRL and verifiers
install with their own dependencies."""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harnesses.conftest import HARNESS_CACHE

TOKENKEEP_DEPS = ("numpy==2.4.6", "httpx==0.28.1")
"""What `tokenkeep` itself imports in a driver (its client and types)."""


def python312() -> str | None:
    """A Python 3.12 interpreter that runs (NeMo Gym requires >= 3.12; this machine's default
    is 3.11, pyenv keeps a 3.12 beside it; a pyenv shim for a version not selected fails)."""
    candidates = sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")))
    candidates += [found] if (found := shutil.which("python3.12")) else []
    for candidate in candidates:
        ran = subprocess.run([candidate, "-c", "pass"], capture_output=True, check=False)
        if ran.returncode == 0:
            return candidate
    return None


def framework_python(
    name: str,
    deps: tuple[str, ...],
    frameworks: tuple[str, ...] = (),
    *,
    python: str = sys.executable,
) -> Path:
    """The interpreter of the virtualenv `name`, built on first use: `deps` with their own
    dependencies, then `frameworks` (if any) with `--no-deps`. Skipped where PyPI is unreachable
    (under CI=true a skip fails)."""
    venv = HARNESS_CACHE / name
    bin_python = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.exists():
        return bin_python
    if venv.exists():
        shutil.rmtree(venv)  # a half-built one from an interrupted run
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    steps = [[*TOKENKEEP_DEPS, *deps]] + ([["--no-deps", *frameworks]] if frameworks else [])
    for arguments in steps:
        done = subprocess.run(
            [str(bin_python), "-m", "pip", "install", "-q", *arguments],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"could not install {name}: {done.stderr[-500:]}")
    marker.touch()
    return bin_python
