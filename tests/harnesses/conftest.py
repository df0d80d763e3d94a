"""Real agent harnesses against a live session server (real port, real tokenizer, memory
store) in front of the engine double, which scripts the tool calls the harness executes."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from session_server.app import build_service, create_app
from session_server.settings import Settings
from tests.api.stack import Stack, qwen3
from tests.engine_double import EngineDouble
from tests.harnesses.recording import RequestRecorder
from tests.live_server import serving
from tests.real_tokenizers import qwen3_dir

# Harness prompts are long (Claude Code sends ~12k tokens of system prompt and tools).
CONTEXT = 65536


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble(max_model_len=CONTEXT).start()
    yield engine
    engine.stop()


@contextmanager
def live_stack(double: EngineDouble, records: list[dict[str, Any]]) -> Iterator[Stack]:
    double.reset()
    config = Settings(
        engine_urls=[double.url],
        model=double.model,
        tokenizer=str(qwen3_dir()),
        context_length=CONTEXT,
    )
    service = build_service(config, model=qwen3())
    app = create_app(config, service)
    app.add_middleware(RequestRecorder, records=records)
    with serving(app) as url:
        yield Stack(app=app, service=service, double=double, url=url)


HARNESS_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "harnesses"


def npm_harness(package: str, version: str, binary: str) -> Path:
    """A harness CLI from npm at a pinned version, installed once into `.cache/harnesses/`
    (skipped where npm or its registry is unavailable; under CI=true a skip fails)."""
    install = HARNESS_CACHE / f"{package.rsplit('/', 1)[-1]}-{version}"
    path = install / "node_modules" / ".bin" / binary
    if not path.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed")
        install.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--prefix", str(install), "--no-audit", "--no-fund",
             f"{package}@{version}"],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0 or not path.exists():
            pytest.skip(f"could not install {package} {version}: {done.stderr[-500:]}")
    shown = subprocess.run(
        [str(path), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert version in shown.stdout
    return path


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A scratch project for a harness CLI, with its own HOME beside it."""
    (tmp_path / "home").mkdir()
    (tmp_path / "project").mkdir()
    yield tmp_path / "project"
