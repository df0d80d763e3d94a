"""Codex CLI (`@openai/codex` from npm), unmodified, `codex exec` against a session URL
(`wire_api = "responses"`): the engine double scripts an `exec_command` call, Codex runs the
command in a scratch project, sends the output back and gets the final answer; the session
records one contiguous trajectory.

Codex sends its default tools (function tools, a `namespace` tool holding its multi-agent
functions, a hosted `web_search`), `store: false`, `include: ["reasoning.encrypted_content"]`,
and resends every item of the conversation, reasoning items included, on each request.
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

VERSION = "0.169.0"


@pytest.fixture(scope="module")
def codex() -> Path:
    return npm_harness("@openai/codex", VERSION, "codex")


def run_codex(codex: Path, project: Path, stack: Stack, session_id: str, prompt: str) -> str:
    home = project.parent / "home"
    provider = (
        f'{{name="tokenkeep",base_url="{stack.url}/sessions/{session_id}/v1",'
        'wire_api="responses",env_key="TOKENKEEP_KEY"}'
    )
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CODEX_HOME": str(home),
        "LANG": "C.UTF-8",
        "TOKENKEEP_KEY": f"tk-{session_id}",
    }
    last = project.parent / "last-message.txt"
    done = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check",
         "--dangerously-bypass-approvals-and-sandbox", "-m", "tiny",
         "-c", "model_provider=tokenkeep", "-c", f"model_providers.tokenkeep={provider}",
         "--output-last-message", str(last), prompt],
        cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return last.read_text().strip()


async def test_exec_tool_loop_is_contiguous(
    double: EngineDouble, codex: Path, project: Path
) -> None:
    records: list[dict[str, Any]] = []
    session = "codex"
    with live_stack(double, records) as stack:
        stack.script(
            tool_call(
                "exec_command",
                '{"cmd":"echo tokenkeep > proof.txt && cat proof.txt"}',
                think="Run the command first.",
            ),
            reply(
                "<think>", "\nIt printed it.\n", "</think>", "\n\n", "The file ", "says tokenkeep."
            ),
        )
        answer = await asyncio.to_thread(
            run_codex, codex, project, stack, session, "Write proof.txt and show it."
        )
        sent = list(records)
        assert answer == "The file says tokenkeep."
        assert (project / "proof.txt").read_text() == "tokenkeep\n"  # Codex ran the command

        stack.assert_contiguous()
        trajectory = await stack.get(f"/sessions/{session}/trajectory")
        [branch] = trajectory["branches"]
        [segment] = branch["segments"]
        assert [t["kind"] for t in segment["turns"]] == ["first", "extend"]

        posts = [r for r in sent if r["method"] == "POST"]
        assert {r["path"] for r in posts} == {f"/sessions/{session}/v1/responses"}
        first, second = (r["body"] for r in posts)
        assert first["store"] is False and "reasoning.encrypted_content" in first["include"]
        assert {t["type"] for t in first["tools"]} >= {"function", "namespace", "web_search"}
        # Codex resent the reasoning item it was given, sealed value included, and the
        # command's output as a function_call_output.
        resent = {item.get("type") for item in second["input"]}
        assert {"reasoning", "function_call", "function_call_output"} <= resent
        [reasoning] = [i for i in second["input"] if i.get("type") == "reasoning"]
        assert reasoning["encrypted_content"].startswith("tk1.")
        [output] = [i for i in second["input"] if i.get("type") == "function_call_output"]
        assert "tokenkeep" in json.dumps(output["output"])
        save_fixture(
            f"codex-{VERSION}",
            f"@openai/codex@{VERSION}",
            sent,
            [c.token_ids for c in stack.sent],
        )
