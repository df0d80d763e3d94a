"""Claude Code (`@anthropic-ai/claude-code` from npm), unmodified, in headless mode against
a session URL: the engine double scripts Bash and Read tool calls, Claude Code executes them
in a scratch project and continues; the session records one contiguous trajectory.

Claude Code always streams Anthropic Messages, sends its environment block as a
mid-conversation `system` turn, and puts a billing header line in its system prompt.
The npm package is installed once into `.cache/harnesses/` (skipped where npm or its
registry is unavailable)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.api.stack import Stack, reply, tool_call
from tests.engine_double import EngineDouble
from tests.harnesses.conftest import live_stack, npm_harness
from tests.harnesses.recording import save_fixture

VERSION = "2.1.330"


@pytest.fixture(scope="module")
def claude() -> Path:
    return npm_harness("@anthropic-ai/claude-code", VERSION, "claude")


def run_claude(
    claude: Path, project: Path, stack: Stack, session_id: str, *arguments: str
) -> dict[str, Any]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(project.parent / "home"),
        "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": f"{stack.url}/sessions/{session_id}",
        "ANTHROPIC_API_KEY": f"tk-{session_id}",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    done = subprocess.run(
        [str(claude), "-p", *arguments, "--allowedTools", "Bash", "Read",
         "--output-format", "json"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout)


async def test_headless_tool_loop_is_contiguous(
    double: EngineDouble, claude: Path, project: Path
) -> None:
    records: list[dict[str, Any]] = []
    session = "claude-code"
    with live_stack(double, records) as stack:
        proof = project / "proof.txt"
        stack.script(
            tool_call(
                "Bash",
                '{"command":"echo tokenkeep > proof.txt","description":"Write"}',
                think="Write the file first.",
            ),
            tool_call("Read", json.dumps({"file_path": str(proof)})),
            reply("The file ", "says tokenkeep."),
        )
        result = await asyncio.to_thread(
            run_claude, claude, project, stack, session, "Write proof.txt, then read it back."
        )
        sent = list(records)
        assert result["result"] == "The file says tokenkeep.", result
        assert proof.read_text() == "tokenkeep\n"  # Claude Code ran the tool calls

        stack.assert_contiguous()
        trajectory = await stack.get(f"/sessions/{session}/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend", "extend"]

        posts = [r for r in sent if r["method"] == "POST"]
        assert {r["path"] for r in posts} == {f"/sessions/{session}/v1/messages"}
        assert all(r["body"]["stream"] for r in posts)
        save_fixture(
            f"claude-code-{VERSION}",
            f"@anthropic-ai/claude-code@{VERSION}",
            sent,
            [c.token_ids for c in stack.sent],
        )
