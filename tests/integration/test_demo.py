"""`tokenkeep demo` end to end: its own vLLM (cached install), the session server on a real
Redis, the SDK-driven tool session, the printed report and the trajectory file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis

from session_server.devtools import demo

pytestmark = pytest.mark.vllm


def test_demo_runs_a_tool_session_in_one_segment(
    redis_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trajectory = tmp_path / "trajectory.jsonl"
    code = demo.main(["--redis-url", redis_server, "--trajectory", str(trajectory), "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0, out

    tool_turns = len([s for s in demo.SCRIPT if s[1]])
    assert f"turns        {len(demo.SCRIPT)} " in out
    assert f"{tool_turns} tool calls" in out
    assert re.search(r"^segments     1$", out, re.M)
    assert re.search(r"^breaks       0$", out, re.M)
    session_id = re.search(r"/sessions/([0-9a-f]{32})/v1", out).group(1)  # type: ignore[union-attr]
    assert f"({redis_server})" in out
    assert redis.Redis.from_url(redis_server).exists(f"tk:{{{session_id}}}:turns")

    [line] = trajectory.read_text().splitlines()
    branch = json.loads(line)
    assert branch["session_id"] == session_id
    [segment] = branch["segments"]
    assert [t["kind"] for t in segment["turns"]] == ["first"] + ["extend"] * (len(demo.SCRIPT) - 1)
    assert len(segment["token_ids"]) == len(segment["loss_mask"]) == len(segment["logprobs"])
    # Every sampled token is a training token with its logprob; the prompts are not.
    for turn in segment["turns"]:
        start, end = turn["completion_span"]
        assert segment["loss_mask"][start:end] == [1] * (end - start)
        assert all(lp is not None for lp in segment["logprobs"][start:end])


def test_vision_demo_runs_a_screenshot_loop_in_one_segment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trajectory = tmp_path / "trajectory.jsonl"
    code = demo.main(["--vision", "--trajectory", str(trajectory), "--seed", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "turns        3 (first 1, extend 2), 2 tool calls, 3 images" in out
    assert re.search(r"^segments     1$", out, re.M)
    assert re.search(r"^breaks       0$", out, re.M)
    [segment] = json.loads(trajectory.read_text())["segments"]
    # One 640x400 screenshot per turn (the first user message, then each tool result).
    assert [[i["length"] for i in t["images"]] for t in segment["turns"]] == [[240], [240], [240]]
    for turn in segment["turns"]:
        for image in turn["images"]:
            run = range(image["offset"], image["offset"] + image["length"])
            assert all(segment["loss_mask"][i] == 0 for i in run)
