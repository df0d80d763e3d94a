"""LiteLLM (`litellm` from PyPI, pinned) against a live session server: Chat Completions and
Responses, streamed and not, a tool loop each (`previous_response_id` on Responses); every
run is one contiguous segment.

LiteLLM pins `openai<3` and the test environment needs `openai>=3` (openai-agents), so it is
installed into its own virtualenv under `.cache/harnesses/` (once; skipped where PyPI is
unreachable) and driven as a subprocess (`litellm_driver.py`), as a user's program would be."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.stack import reply, tool_call
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import live_stack

VERSION = "1.106.2"
REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".cache" / "harnesses" / f"litellm-{VERSION}"
DRIVER = Path(__file__).with_name("litellm_driver.py")


@pytest.fixture(scope="module")
def litellm_python() -> Path:
    python = VENV / "bin" / "python"
    marker = VENV / ".installed"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"litellm[mcp]=={VERSION}"],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"could not install litellm {VERSION}: {done.stderr[-500:]}")
        marker.touch()
    return python


def drive(python: Path, base: str, mode: str) -> str:
    done = subprocess.run(
        [str(python), str(DRIVER), base, mode],
        capture_output=True, text=True, timeout=300, check=False,
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["answer"]


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
