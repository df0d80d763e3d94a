"""`tokenkeep sessions list | show` against a live server, piped and on a terminal."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import httpx
import pytest

from tests.viewer.conftest import SAMPLED_ANSWER, Live, drive_rich_session
from tokenkeep.cli import sessions as sessions_cli


@pytest.fixture(scope="module")
def rich(live: Live) -> str:
    drive_rich_session(live, "viewer-terminal")
    return "viewer-terminal"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "session_server.cli", "sessions", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_list_piped(live: Live, rich: str) -> None:
    result = run_cli("--url", live.url, "list")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith(rich))
    summary = httpx.get(f"{live.url}/sessions/{rich}").json()
    # id, date, time, then turns, segments, tokens
    assert line.split()[3:6] == ["4", "2", str(summary["tokens"])]
    assert "assistant_message_not_sampled x1" in line
    assert "\x1b[" not in result.stdout


def test_show_piped_marks_sampled_runs_and_breaks(live: Live, rich: str) -> None:
    result = run_cli("--url", live.url, "show", rich, "--branch", "0")
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout
    assert "«" + "".join(SAMPLED_ANSWER) + "<|im_end|>»" in result.stdout
    assert "segment 1: first" in result.stdout
    rewritten = run_cli("--url", live.url, "show", rich).stdout
    assert "segment 2: new segment, reason: assistant_message_not_sampled" in rewritten
    assert rewritten.rstrip().splitlines()[-1].startswith(f"session {rich} branch 2/2: 4 turns")


def test_show_on_a_terminal_colours_tokens(live: Live, rich: str) -> None:
    data = httpx.get(f"{live.url}/ui/api/sessions/{rich}").json()
    out = io.StringIO()
    sessions_cli.print_session(data, 0, out, tty=True)
    text = out.getvalue()
    assert sessions_cli._SAMPLED[0] + "It" in text or sessions_cli._SAMPLED[1] + "It" in text
    assert sessions_cli._SPECIAL + "<|im_start|>" in text
    # A real terminal: the command itself picks colours when stdout is a TTY.
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "session_server.cli", "sessions", "--url", live.url, "show", rich],
        stdout=follower,
        stderr=subprocess.PIPE,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(60) == 0
    os.close(leader)
    assert sessions_cli._SPECIAL.encode() in b"".join(chunks)


def test_errors_are_one_line(live: Live) -> None:
    result = run_cli("--url", live.url, "show", "no-such-session")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "tokenkeep sessions: HTTP 404: session 'no-such-session' not found"
    )


def test_a_branch_the_session_lacks_is_one_line_and_exit_2(live: Live, rich: str) -> None:
    result = run_cli("--url", live.url, "show", rich, "--branch", "99")
    assert result.returncode == 2
    assert (
        result.stderr.strip() == "tokenkeep sessions: no branch 99: the session has branches 0..2"
    )
    assert result.stdout == ""
