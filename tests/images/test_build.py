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
