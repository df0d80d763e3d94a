"""`tokenkeep demo --vision` end to end: its own vision engine (the path `make demo` takes), the
SDK-driven screenshot loop, the printed report and the trajectory file. The text demo is
checked kept up, from a clean shell, in tests/newcomer/test_first_hour.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from session_server.devtools import demo

pytestmark = pytest.mark.vllm


def test_vision_demo_runs_a_screenshot_loop_in_one_segment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trajectory = tmp_path / "trajectory.jsonl"
    code = demo.main(["--vision", "--trajectory", str(trajectory), "--seed", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    # Under pytest stdin is no terminal: the stack is not kept, and the demo says so.
    assert "The stack has stopped" in out
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
