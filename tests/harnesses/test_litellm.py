"""LiteLLM (`litellm` from PyPI, pinned) against a live session server: Chat Completions and
Responses, streamed and not, a tool loop each (`previous_response_id` on Responses); every
run is one contiguous segment. mini-swe-agent (pinned, on LiteLLM) runs its default
tool-calling agent on a task: contiguous while it keeps its history; a reply in the wrong
format it drops from its history makes a second branch (counted as a `fork` turn).

LiteLLM pins `openai<3` and the test environment needs `openai>=3` (openai-agents), so it is
installed into its own virtualenv under `.cache/harnesses/` (once; skipped where PyPI is
unreachable) and driven as a subprocess (`litellm_driver.py`), as a user's program would be."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.api.stack import reply, tool_call
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.harnesses.conftest import live_stack

VERSION = "1.106.2"
MINI_SWE_AGENT = "2.4.6"
REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".cache" / "harnesses" / f"litellm-{VERSION}-mini-swe-agent-{MINI_SWE_AGENT}"
DRIVER = Path(__file__).with_name("litellm_driver.py")
MINI_DRIVER = Path(__file__).with_name("mini_swe_agent_driver.py")


@pytest.fixture(scope="module")
def litellm_python() -> Path:
    python = VENV / "bin" / "python"
    marker = VENV / ".installed"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"litellm[mcp]=={VERSION}",
             f"mini-swe-agent=={MINI_SWE_AGENT}"],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"could not install litellm {VERSION}: {done.stderr[-500:]}")
        marker.touch()
    return python


def drive(python: Path, base: str, mode: str) -> str:
    return run_script(python, DRIVER, base, mode)["answer"]


def run_script(python: Path, script: Path, *arguments: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), str(script), *arguments],
        capture_output=True, text=True, timeout=300, check=False,
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["chat", "chat-stream", "responses", "responses-stream"])
async def test_tool_loop_is_contiguous(
    double: EngineDouble, litellm_python: Path, mode: str
) -> None:
    session = f"litellm-{mode}"
    with live_stack(double, []) as stack:
        stack.script(
            tool_call("get_weather", '{"city": "Paris"}', think="Check it."),
            reply("Paris", " is sunny."),
        )
        answer = await asyncio.to_thread(
            drive, litellm_python, f"{stack.url}/sessions/{session}/v1", mode
        )
        assert answer == "Paris is sunny."
        stack.assert_contiguous()
        trajectory = await stack.get(f"/sessions/{session}/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend"]


def bash(command: str) -> ScriptedCompletion:
    return tool_call("bash", json.dumps({"command": command}))


@pytest.mark.parametrize("format_error", [False, True], ids=["clean", "format-error"])
async def test_mini_swe_agent(
    double: EngineDouble, litellm_python: Path, tmp_path: Path, format_error: bool
) -> None:
    session = f"mini-{format_error}"
    with live_stack(double, []) as stack:
        stack.script(
            bash("echo tokenkeep > proof.txt"),
            *([reply("I will just answer in prose.")] if format_error else []),
            bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat proof.txt"),
        )
        result = await asyncio.to_thread(
            run_script, litellm_python, MINI_DRIVER, f"{stack.url}/sessions/{session}/v1",
            str(tmp_path), "Write proof.txt, then submit it.",
        )  # fmt: skip
        assert result == {"exit_status": "Submitted", "submission": "tokenkeep\n"}
        assert (tmp_path / "proof.txt").read_text() == "tokenkeep\n"
        summary = await stack.get(f"/sessions/{session}")
        assert summary["breaks"] == {} and summary["segments"] == 1
        if format_error:
            # The prose reply is dropped from mini-swe-agent's history, so the next request
            # continues from before it: a second branch, each branch contiguous.
            assert summary["branches"] == 2
            assert summary["turns_by_kind"] == {"first": 1, "extend": 1, "fork": 1}
        else:
            assert summary["branches"] == 1
            assert summary["turns_by_kind"] == {"first": 1, "extend": 1}
            stack.assert_contiguous()
