"""A newcomer's first hour, scripted: the README's first command (`make demo`), then every
command the demo and the README suggest next, typed into a clean shell (the virtualenv not
on PATH, no TOKENKEEP_* settings), against the stack the demo keeps up. The printed tool
loop, run as printed, must get a tool call from the random model in one contiguous segment.

The demo runs the exact command `make demo` runs, against the tier's shared vLLM
(`--engine-url`, so no second engine starts) and a real Redis: `make` itself would install
into the virtualenv first, which in a worktree is another checkout's. The demo's own report
and trajectory are checked on the same run (the vision demo, which starts its own engine as
`make demo` does, is in tests/integration/test_demo.py).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from session_server.devtools import demo
from tests.vllm_fixture import RunningEngine, vllm_engine
from tokenkeep.cli import local_stack_file

pytestmark = pytest.mark.vllm
__all__ = ["vllm_engine"]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# The closing block's last line: the printed tool loop ends here.
LOOP_END = 'print("segments:'


def clean_shell() -> dict[str, str]:
    """The environment of a shell that has just cloned the repository: no virtualenv on
    PATH, no TOKENKEEP_* setting but where tokenkeep caches its engine, and not inside a
    `make` (under `make test`, MAKELEVEL and MAKEFLAGS would make a nested make print its
    directory)."""
    path = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != VENV_BIN
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TOKENKEEP_")
        and k not in ("VIRTUAL_ENV", "PYTHONHOME", "MAKELEVEL", "MAKEFLAGS", "MFLAGS")
    }
    cache = os.environ.get("TOKENKEEP_CACHE_DIR")
    return env | {"PATH": path} | ({"TOKENKEEP_CACHE_DIR": cache} if cache else {})


def typed(lines: list[str], command: str) -> subprocess.CompletedProcess[str]:
    """`command` typed into a clean bash at the repository root, after `lines` (the
    closing block's set-up line, where it has one)."""
    script = "\n".join([*lines, command])
    return subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=clean_shell(), capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def assert_ran(result: subprocess.CompletedProcess[str], command: str) -> None:
    assert "command not found" not in result.stderr, (command, result.stderr)
    assert "Traceback" not in result.stderr, (command, result.stderr)
    assert result.returncode == 0, (command, result.stdout, result.stderr)


@dataclass
class KeptDemo:
    process: subprocess.Popen[str]
    stdout: str
    trajectory: Path


@pytest.fixture(scope="module")
def kept_demo(
    vllm_engine: RunningEngine, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KeptDemo]:
    """`make demo`'s command with the stack kept up (on a real Redis: `--redis-url`, the
    demo's other store), read until its closing block ends."""
    out = tmp_path_factory.mktemp("demo")
    trajectory = out / "trajectory.jsonl"
    argv = [str(VENV_BIN / "tokenkeep"), "demo", "--keep-running", "--engine-url",
            vllm_engine.url, "--redis-url", redis_server, "--trajectory", str(trajectory),
            "--seed", "5"]  # fmt: skip
    started = time.monotonic()
    with open(out / "stderr", "w") as stderr:
        process = subprocess.Popen(
            argv, cwd=REPO, env=clean_shell(), stdout=subprocess.PIPE, stderr=stderr
        )
    assert process.stdout is not None
    # Raw reads of the pipe, not readline(): a buffered reader pulls the closing block in
    # with the report, and select() on the then-empty pipe would wait out the deadline.
    fd = process.stdout.fileno()
    received = b""
    deadline = started + 600  # five turns on a loaded CPU
    loop_end = re.compile(rb"^" + re.escape(LOOP_END.encode()) + rb".*\n", re.M)
    while not (end := loop_end.search(received)):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            process.kill()
            pytest.fail(f"no closing block: {received.decode()}{(out / 'stderr').read_text()}")
        received += chunk
    stdout = received[: end.end()].decode()  # up to the loop's last line, as printed
    kept = KeptDemo(process, stdout, trajectory)
    try:
        yield kept
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(30)


def test_the_demo_keeps_its_tool_session_in_one_segment(
    kept_demo: KeptDemo, redis_server: str
) -> None:
    """The demo's own report and trajectory: every scripted turn, its tool calls, one
    segment, no break, in Redis; sampled tokens are the training tokens, with logprobs."""
    out = kept_demo.stdout
    tool_turns = len([s for s in demo.SCRIPT if s[1]])
    assert f"turns        {len(demo.SCRIPT)} " in out
    assert f"{tool_turns} tool calls" in out
    assert re.search(r"^segments     1$", out, re.M)
    assert re.search(r"^breaks       0$", out, re.M)
    session_id = re.search(r"/sessions/([0-9a-f]{32})/v1", out).group(1)  # type: ignore[union-attr]
    assert f"({redis_server})" in out
    assert redis.Redis.from_url(redis_server).exists(f"tk:{{{session_id}}}:turns")

    [line] = kept_demo.trajectory.read_text().splitlines()
    branch = json.loads(line)
    assert branch["session_id"] == session_id
    [segment] = branch["segments"]
    assert [t["kind"] for t in segment["turns"]] == ["first"] + ["extend"] * (len(demo.SCRIPT) - 1)
    assert len(segment["token_ids"]) == len(segment["loss_mask"]) == len(segment["logprobs"])
    for turn in segment["turns"]:
        start, end = turn["completion_span"]
        assert segment["loss_mask"][start:end] == [1] * (end - start)
        assert all(lp is not None for lp in segment["logprobs"][start:end])


def next_commands(stdout: str) -> tuple[list[str], list[str]]:
    """The closing block's commands: its set-up lines (`source .../activate`), the rest."""
    block = stdout.split("From another terminal, here:\n", 1)[1].split("\n\n", 1)[0]
    commands = [line.strip() for line in block.splitlines() if not line.strip().startswith("#")]
    setup = [c for c in commands if c.startswith("source ")]
    return setup, [c for c in commands if c not in setup]


def test_make_demo_runs_the_demo_with_the_virtualenvs_tokenkeep() -> None:
    """The README's first command, in a clean shell: `make demo` runs `.venv/bin/tokenkeep`
    (what the closing block's `source .venv/bin/activate` puts on PATH)."""
    result = subprocess.run(
        ["make", "-n", "demo"], cwd=REPO, env=clean_shell(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].strip() == ".venv/bin/tokenkeep demo"
    assert "'.[test]'" not in result.stdout  # the demo installs no test extras


def test_every_suggested_command_runs_as_typed(kept_demo: KeptDemo) -> None:
    """...and Ctrl-C then stops the stack, which `tokenkeep sessions` stops finding."""
    setup, commands = next_commands(kept_demo.stdout)
    assert setup, kept_demo.stdout  # tokenkeep is not on a clean shell's PATH
    assert len(commands) == 3, commands
    url = re.search(r"^session server (http://\S+)", kept_demo.stdout, re.M).group(1)  # type: ignore[union-attr]
    demo_session = re.search(r"/sessions/([0-9a-f]{32})/v1", kept_demo.stdout).group(1)  # type: ignore[union-attr]
    assert json.loads(local_stack_file().read_text())["url"] == url
    results = {command.split()[0]: (command, typed(setup, command)) for command in commands}
    for command, result in results.values():
        assert_ran(result, command)

    # `tokenkeep sessions` found the demo without --url, and lists its session.
    assert demo_session in results["tokenkeep"][1].stdout
    # The curl gives what a harness needs.
    created = json.loads(results["curl"][1].stdout)
    assert created["openai_base_url"].startswith(f"{url}/sessions/") and created["api_key"]
    assert created["reasoning_ended"] is True
    # The user's own loop (the file holds the snippet printed below it): a tool call from the
    # random model, both turns in one segment.
    command, loop = results["python"]
    printed = kept_demo.stdout.split("docs/harnesses.md):\n\n", 1)[1]
    assert Path(command.split()[1]).read_text() == printed
    assert loop.stdout.startswith("tool call: get_weather {'city': '"), loop.stdout
    assert loop.stdout.count("tool call: get_weather") == 2, loop.stdout
    assert "segments: 1 " in loop.stdout, loop.stdout

    kept_demo.process.send_signal(signal.SIGINT)
    assert kept_demo.process.wait(60) == 0
    assert not local_stack_file().exists()
    gone = typed(setup, "tokenkeep sessions")
    assert gone.returncode == 2 and "tokenkeep demo" in gone.stderr, gone.stderr


def test_the_readmes_commands_exist_in_the_activated_shell(kept_demo: KeptDemo) -> None:
    """Every `tokenkeep <command>` the README names runs in the shell the closing block
    leaves (after its `source` line): no "command not found", no unknown command."""
    setup, _ = next_commands(kept_demo.stdout)
    readme = (REPO / "README.md").read_text()
    named = sorted(set(re.findall(r"\btokenkeep (serve|check|engine|demo|sessions|export|"
                                  r"operator)\b", readme)))  # fmt: skip
    assert {"demo", "serve", "engine", "check"} <= set(named)
    result = typed(setup, "; ".join(f"tokenkeep {n} --help >/dev/null || exit 1" for n in named))
    assert_ran(result, f"tokenkeep {{{','.join(named)}}} --help")
