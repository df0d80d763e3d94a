"""`tokenkeep check` on the families the tests ship (real tokenizers, real templates), as a
user runs it; and its answers to folders it cannot check."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from session_server import check
from session_server.check import load_model, startup, startup_check
from tests.real_tokenizers import llama32_dir, qwen3_dir

SCENARIO_KEYS = {
    "name",
    "api",
    "stream",
    "naive_contiguous",
    "contiguous",
    "calls_parsed",
    "stream_equal",
    "reason",
}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "session_server.cli", "check", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=None if env is None else os.environ | env,
    )


def assert_contiguous(result: subprocess.CompletedProcess[str], renderer: str) -> dict[str, Any]:
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {
        "model",
        "renderer",
        "path_reason",
        "contiguous",
        "tool_calls_parsed",
        "stream_equal",
        "ok",
        "scenarios",
    }
    assert report["renderer"] == renderer
    assert report["contiguous"] is True
    # The scripted tool calls reach every API as calls, and each stream equals its twin.
    assert report["tool_calls_parsed"] is True and report["stream_equal"] is True
    calls = [r for r in report["scenarios"] if r["name"].endswith("tool_call")]
    assert calls and all(r["calls_parsed"] is True for r in calls)
    assert all(r["stream_equal"] is True for r in report["scenarios"] if r["stream"])
    rows = report["scenarios"]
    assert all(set(row) == SCENARIO_KEYS for row in rows)
    assert {row["api"] for row in rows} == {"chat", "responses", "messages"}
    assert {row["stream"] for row in rows} == {True, False}
    assert all(row["contiguous"] for row in rows)
    assert "checking [1/" in result.stderr  # the progress line
    return report


def test_qwen3_is_contiguous_where_a_rerender_breaks_its_reasoning() -> None:
    report = assert_contiguous(run_cli("--tokenizer", str(qwen3_dir()), "--json"), "qwen3")
    reasoning = [r for r in report["scenarios"] if r["name"].startswith("reasoning")]
    assert {r["name"] for r in reasoning} == {"reasoning", "reasoning_then_tool_call"}
    assert all(not r["naive_contiguous"] for r in reasoning)
    # The template drops an earlier turn's reasoning: the text itself changes, not a split.
    plain = [r for r in reasoning if r["name"] == "reasoning"]
    assert all("naive: turn 2" in r["reason"] and "text changed" in r["reason"] for r in plain)


def test_admin_key_in_the_environment_does_not_lock_the_check_out() -> None:
    """Operator-managed servers have TOKENKEEP_ADMIN_KEY set: the check's in-process requests
    must still be answered (they once all got 401, read as "every scenario breaks")."""
    env = {"TOKENKEEP_ADMIN_KEY": "admin-" + "k" * 40}
    result = run_cli("--tokenizer", str(qwen3_dir()), "--json", env=env)
    assert_contiguous(result, "qwen3")
    assert "401" not in result.stdout


def test_llama32_is_contiguous_and_names_its_path() -> None:
    result = run_cli("--tokenizer", str(llama32_dir()))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "path:     hand-written renderer 'llama-3'" in result.stdout
    assert "verdict: CONTIGUOUS" in result.stdout
    # Llama 3.2's template renders no reasoning: those scenarios are reported as not applicable.
    assert "reasoning: the template does not render reasoning" in result.stdout


@pytest.mark.parametrize("directory", [qwen3_dir, llama32_dir], ids=["qwen3", "llama-3.2"])
def test_generic_splice_is_contiguous_on_both_families(directory: Any) -> None:
    """The path a family without a hand-written renderer takes, on the shipped families."""
    model = load_model(str(directory()), "generic")
    report = _run(check.run_check(model, apis=("chat", "messages"), streams=(True,)))
    assert report.renderer == "generic"
    assert report.contiguous, [r.reason for r in report.rows if not r.contiguous]


def _run(coroutine: Any) -> Any:
    import asyncio

    return asyncio.run(coroutine)


def _tokenizer_folder(tmp_path: Path, template: str | None) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    source = llama32_dir()
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp, "no tokenizer here"),
        (lambda tmp: tmp / "missing", "not a directory"),
        (lambda tmp: _tokenizer_folder(tmp, None), "has no chat template"),
        (
            lambda tmp: _tokenizer_folder(tmp, "{{ raise_exception('roles must alternate') }}"),
            "the chat template fails: roles must alternate",
        ),
        (lambda tmp: _tokenizer_folder(tmp, "{% for m in messages %}"), "the chat template fails"),
    ],
    ids=["empty-folder", "missing-folder", "no-template", "template-raises", "template-broken"],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, message: str
) -> None:
    code = check.main(["--tokenizer", str(make(tmp_path))])
    out = capsys.readouterr()
    assert code == 2
    assert out.out == ""
    assert message in out.err
    assert len(out.err.strip().splitlines()) == 1
    assert "Traceback" not in out.err


def test_bad_input_from_the_command_line_has_no_traceback(tmp_path: Path) -> None:
    result = run_cli("--tokenizer", str(tmp_path))
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"tokenkeep check: {tmp_path}: no tokenizer here (no tokenizer.json)"
    )


def test_startup_check_logs_the_verdict_and_caches_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(llama32_dir()))
    verdicts: list[bool] = []
    with caplog.at_level(logging.INFO, logger="tokenkeep.check"):
        assert startup_check(model, tmp_path, verdicts.append) is True
    assert "start-up check: token-exact on" in caplog.text
    assert len(list(tmp_path.glob("*.json"))) == 1

    async def not_again(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the cached verdict should be used")

    monkeypatch.setattr(startup, "run_check", not_again)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenkeep.check"):
        assert startup_check(model, tmp_path, verdicts.append) is True
    assert "start-up check (cached): token-exact" in caplog.text
    assert verdicts == [True, True]


@pytest.mark.parametrize(("renderer", "expected"), [("auto", 0.0), ("generic", 1.0)])
def test_generic_splice_metric(renderer: str, expected: float) -> None:
    from session_server.app import build_service
    from session_server.settings import Settings
    from session_server.store.memory import MemoryStore

    settings = Settings(engine_urls=["http://127.0.0.1:9"], tokenizer=str(llama32_dir()))
    service = build_service(
        settings, store=MemoryStore(), model=load_model(settings.tokenizer, renderer)
    )
    registry = service.metrics.registry
    assert registry.get_sample_value("tokenkeep_generic_splice_families") == expected
    assert registry.get_sample_value("tokenkeep_check_contiguous") == -1


@pytest.mark.parametrize("renderer", ["auto", "generic"])
def test_generation_prompt_that_opens_reasoning_streams_contiguously(
    tmp_path: Path, renderer: str
) -> None:
    """QwQ / DeepSeek-R1 style: the generation prompt itself ends in `<think>`, so the reply
    starts inside the reasoning block; streamed replies must parse as the whole ones do."""
    source = qwen3_dir()
    folder = tmp_path / "qwq-style"
    folder.mkdir()
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    opener = "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}"
    assert opener in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(
        opener, opener.replace("assistant\\n'", "assistant\\n<think>\\n'")
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = load_model(str(folder), renderer)
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    assert model.opens_reasoning(list(prompt))
    report = _run(check.run_check(model, apis=("chat", "messages"), streams=(True,)))
    assert report.rows and report.contiguous, [r.reason for r in report.rows if not r.contiguous]


def test_template_that_closes_a_turn_by_opening_the_next(tmp_path: Path) -> None:
    """GLM style: no end-of-turn token after an assistant message; the next message's role
    token closes it (and the model stops on it). Here on the Qwen3 vocabulary."""
    source = qwen3_dir()
    folder = tmp_path / "glm-style"
    folder.mkdir()
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = load_model(str(folder))
    assert model.family == "generic"
    assert model.tokenizer.convert_ids_to_tokens(model.close_token_id) == "<|im_start|>"
    assert model.close_token_id in model.stop_token_ids
    report = _run(check.run_check(model, apis=("chat",)))
    assert report.rows and report.contiguous, [r.reason for r in report.rows if not r.contiguous]
