"""examples/grpo_rollouts.py runs as a user runs it (its own process, the OpenAI SDK as the
harness) against a live session server in front of the engine double."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.engine_double import ScriptedCompletion
from tests.session.conftest import Stack

EXAMPLE = Path(__file__).parents[2] / "examples" / "grpo_rollouts.py"


def test_grpo_example_end_to_end(memory_stack: Stack) -> None:
    answers = itertools.cycle(["It is 42.", "It is 41."])
    model = memory_stack.model

    def sample(_prompt: list[int], _sampling: dict[str, Any]) -> ScriptedCompletion:
        return ScriptedCompletion(model.encode(next(answers)) + model.stop_token_ids[:1])

    memory_stack.double.default = sample
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", memory_stack.url, "--group-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # 3 questions x 2 rollouts, one segment each, 2 turns per rollout.
    assert done.stdout.startswith("6 rollouts -> 6 rows x ")
    assert len(memory_stack.double.requests) == 12
    with memory_stack.http() as http:  # the example deleted its sessions
        assert http.get("/sessions", params={"selector": "group=What is 3 cubed?"}).json() == {
            "sessions": []
        }
