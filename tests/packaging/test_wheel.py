"""What users install runs: the wheel, built the way the Dockerfile builds it, installed into a
clean virtualenv with its runtime dependencies only (no test extras), serves a turn.

The image itself needs a Docker daemon, which these machines lack; instead the wheel is built
from exactly the files the Dockerfile copies, with the Dockerfile's own `pip wheel` and
`pip install` lines, so the image's install path is the one tested here.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import qwen3_dir

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PACKAGE_DIRS = ("session_server", "operator/tokenkeep_operator")


@dataclass(frozen=True)
class DockerInstall:
    copies: list[str]
    """Sources of the build stage's COPY lines (relative to the repository root)."""
    wheel_args: list[str]
    """`pip wheel` arguments, with the build stage's wheel folder as `{wheels}`."""
    install_args: list[str]
    """`pip install` arguments of the runtime stage, with the wheel folder as `{wheels}`."""


def read_dockerfile() -> DockerInstall:
    """The build stage's COPY sources and the two pip command lines, as the image runs them."""
    copies: list[str] = []
    wheel_args: list[str] = []
    install_args: list[str] = []
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "COPY" and not any(w.startswith("--from") for w in words):
            copies.extend(words[1:-1])
        if words[0] != "RUN":
            continue
        command = " ".join(words[1:]).split("&&")[0].split()
        if command[:2] == ["pip", "wheel"]:
            wheel_args = [w.replace("/wheels", "{wheels}") for w in command[2:]]
        elif command[:2] == ["pip", "install"]:
            install_args = [w.replace("/wheels", "{wheels}") for w in command[2:]]
    return DockerInstall(copies, wheel_args, install_args)


def clean_env() -> dict[str, str]:
    """The environment of a user's shell: nothing of the test run's virtualenv leaks in."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    docker = read_dockerfile()
    assert docker.wheel_args and docker.install_args, "Dockerfile: pip wheel / pip install lines"
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for copied in docker.copies:
        source = REPO / copied
        if source.is_dir():
            shutil.copytree(source, src / copied, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(source, src / copied)
    wheels = root / "wheels"

    def fill(args: list[str]) -> list[str]:
        """The arguments as the image's shell passes them: folder filled in, globs expanded."""
        filled = [a.replace("{wheels}", str(wheels)) for a in args]
        return [m for a in filled for m in (sorted(glob.glob(a)) if "*" in a else [a])]

    python = sys.executable
    build = subprocess.run(
        [python, "-m", "pip", "wheel", *fill(docker.wheel_args)],
        cwd=src, env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    venv = root / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    # As in the image, but with pip's cache: the same resolution, a faster second run.
    install_args = [a for a in fill(docker.install_args) if a != "--no-cache-dir"]
    pip_install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", *install_args],
        cwd=root, env=clean_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert pip_install.returncode == 0, pip_install.stdout + pip_install.stderr
    assert "Deprecat" not in build.stdout + build.stderr + pip_install.stderr
    (wheel,) = wheels.glob("tokenkeep-*.whl")
    return Installed(wheel, venv)


def test_runtime_dependencies_are_consistent(installed: Installed, tmp_path: Path) -> None:
    check = installed.run(installed.bin("python"), "-m", "pip", "check", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    test_only = installed.run(installed.bin("python"), "-c", "import pytest", cwd=tmp_path)
    assert test_only.returncode != 0, "a test-only dependency is installed at run time"


def test_every_module_imports_from_the_wheel(installed: Installed, tmp_path: Path) -> None:
    """Every module the console script can reach imports with runtime dependencies only."""
    script = (
        "import importlib, pkgutil, session_server, tokenkeep_operator\n"
        "for package in (session_server, tokenkeep_operator):\n"
        "    assert '/site-packages/' in package.__file__, package.__file__\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
    )
    result = installed.run(installed.bin("python"), "-c", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def _tracked_package_files() -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", *PACKAGE_DIRS], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    files = set()
    for path in listed:
        if path.endswith(".md"):
            continue  # documentation beside the code, not package data
        files.add(path.removeprefix("operator/"))
    return files


def test_wheel_holds_the_tracked_package_files(installed: Installed) -> None:
    """Lua scripts (and any other file tracked in the packages) are inside the wheel."""
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    tracked = _tracked_package_files()
    assert any(name.endswith(".lua") for name in tracked)
    missing = sorted(tracked - names)
    assert not missing, f"not in the wheel: {missing}"


@pytest.mark.parametrize("command", ["operator", "engine", "demo", "check", "sessions", "export"])
def test_subcommands_start(installed: Installed, tmp_path: Path, command: str) -> None:
    result = installed.run(installed.bin("tokenkeep"), command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage:" in result.stdout


@pytest.fixture
def engine() -> Iterator[EngineDouble]:
    double = EngineDouble().start()
    try:
        yield double
    finally:
        double.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_installed_server_serves_a_turn(
    installed: Installed, engine: EngineDouble, tmp_path: Path
) -> None:
    """`tokenkeep serve` from the clean virtualenv completes a chat turn over HTTP."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json"))
    answer = tokenizer.encode("Hello there", add_special_tokens=False).ids
    engine.script(ScriptedCompletion([*answer, tokenizer.token_to_id("<|im_end|>")]))
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            installed.bin("tokenkeep"), "serve", "--engine-url", engine.url,
            "--model", engine.model, "--tokenizer", str(qwen3_dir()),
            "--host", "127.0.0.1", "--port", str(port),
        ],
        cwd=tmp_path, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        response = httpx.post(
            f"{base}/sessions/wheel-1/v1/chat/completions",
            json={"model": engine.model, "messages": [{"role": "user", "content": "Hi"}]},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "Hello there"
        trajectory = httpx.get(f"{base}/sessions/wheel-1/trajectory", timeout=10).json()
        (branch,) = trajectory["branches"]
        (segment,) = branch["segments"]
        sampled = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
        assert sampled == [*answer, tokenizer.token_to_id("<|im_end|>")]
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def test_python_in_the_repository_root_imports_the_standard_library(installed: Installed) -> None:
    """Nothing at the repository root shadows a standard library module."""
    result = installed.run(
        installed.bin("python"), "-c", "import json, glob, enum, operator", cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert not (REPO / "operator" / "__init__.py").exists()
