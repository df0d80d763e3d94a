"""`make images` refuses an archive the disk cannot hold before writing any of it."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("images_build", REPO / "images" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free(monkeypatch: pytest.MonkeyPatch, build: ModuleType, free: int) -> None:
    real = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        return real(path)._replace(free=free)

    monkeypatch.setattr(build.shutil, "disk_usage", disk_usage)


def test_an_archive_the_disk_cannot_hold_is_refused_with_what_to_do(
    build: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    (root / "opt").mkdir(parents=True)
    (root / "opt" / "weights").write_bytes(b"\0" * (3 << 20))
    (root / "link").symlink_to("opt/weights")  # counted once
    out = tmp_path / "engine.tar"
    _free(monkeypatch, build, (1 << 30) + (6 << 20) - 1)  # 2 x 3 MiB + 1 GiB, less a byte
    with pytest.raises(SystemExit, match=r"engine\.tar needs about 1 GiB free .* 3 MiB"):
        build._check_space(root, out)
    assert not out.exists()
    _free(monkeypatch, build, (1 << 30) + (6 << 20))
    build._check_space(root, out)


def test_the_engine_image_ships_tokenkeep_vllm_in_site_packages(
    build: ModuleType, tmp_path: Path
) -> None:
    """The ModelServer pods start vLLM with `--middleware tokenkeep_vllm.EngineKey` and
    `--worker-extension-cls tokenkeep_vllm.TiedReload`: the image's own Python must import it."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    build._add_extension(tmp_path / "venv")
    shipped = site / "tokenkeep_vllm.py"
    source = REPO / "session_server" / "vllm_extension.py"
    assert shipped.read_bytes() == source.read_bytes()
    spec = importlib.util.spec_from_file_location("tokenkeep_vllm", shipped)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    worker, middleware = build.localengine.WORKER_EXTENSION, build.localengine.KEY_MIDDLEWARE
    assert hasattr(module, worker.split(".")[1]) and hasattr(module, middleware.split(".")[1])


def test_the_engine_image_is_rebuilt_when_tokenkeep_vllm_changes(
    build: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    venv, model = tmp_path / "venv", tmp_path / "model"
    venv.mkdir()
    model.mkdir()
    (venv / "installed.json").write_text("{}")
    (model / "built.json").write_text("{}")
    extension = tmp_path / "vllm_extension.py"
    engine = build.localengine
    monkeypatch.setattr(engine, "install", lambda: Path(sys.executable))
    monkeypatch.setattr(engine, "build_model", lambda: model)
    monkeypatch.setattr(engine, "venv_dir", lambda: venv)
    monkeypatch.setattr(engine, "EXTENSION_SOURCE", extension)
    monkeypatch.setattr(build, "DEBIAN_PYTHON", sys.version_info[:2])
    monkeypatch.setattr(build, "base", lambda name: Path(f"base-{name}.tar"))
    keys: list[str] = []
    monkeypatch.setattr(build, "_cached", lambda out, key: keys.append(key) or True)
    for text in ("one", "one", "two"):
        extension.write_text(text)
        build.engine_image()
    assert keys[0] == keys[1] != keys[2]
