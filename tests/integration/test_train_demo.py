"""`tokenkeep demo --train` against the real vLLM CPU engine (the session-wide dev-mode
engine, so no second engine starts; the demo gives it its original weights back): a few
GRPO steps whose new weights the running engine really samples from. The reward curve of a
full run is in bench/results/train.md (too slow for CI)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from session_server.devtools import demo, train
from tests.vllm_fixture import RunningEngine

pytestmark = pytest.mark.vllm


def test_a_few_grpo_steps_reach_the_running_engine(
    vllm_engine: RunningEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps, size = 3, 4
    probe = [151644, 872, 198, 3838, 374, 279, 9104, 304, 62578, 30]
    with httpx.Client(base_url=vllm_engine.url, timeout=120) as http:
        original = train.Engine(vllm_engine.url, vllm_engine.served_model_name)
        before = original.prompt_logprobs(probe)
        code = demo.main(
            [
                "--train",
                "--steps",
                str(steps),
                "--group-size",
                str(size),
                "--json",
                "--trajectory-dir",
                str(tmp_path),
                "--engine-url",
                vllm_engine.url,
            ]
        )
        out = capsys.readouterr().out
        assert code == 0, out
        *lines, last = [json.loads(line) for line in out.splitlines()]
        summary = last["summary"]

        assert [line["step"] for line in lines] == list(range(steps))
        assert [line["new_version"] for line in lines] == ["1", "2", "3"]
        assert summary["final_version"] == "3"
        assert summary["engine_matches_learner"] is True
        for line in lines:
            assert line["rollouts"] == size and line["failed"] == 0
            assert set(line) >= {"step", "mean_reward", "weight_version", "rollouts", "tokens"}
            # The newest version that sampled step k is the one loaded before it.
            assert line["weight_version"] == str(line["step"])
            # The engine's logprobs are the learner's, under the weights just loaded (bf16
            # rounding apart): a stale output layer would leave them where they were.
            assert line["probe_gap"] < 0.02 and line["engine_matches_learner"], line
            assert line["logprob_gap_current"] < 0.02, line
            # Published through tokenkeep's POST /policy (the fleet refuses a reload whose
            # tied output layer is off the checkpoint).
            assert line["publish_seconds"] > 0 and line["pause_seconds"] >= line["publish_seconds"]
        moved = [line for line in lines if line["loss"] != 0.0]
        assert all(line["probe_shift"] > 10 * line["probe_gap"] for line in moved), lines

        files = sorted(tmp_path.glob("step*.json"))
        assert len(files) == steps * size
        for path in files:
            data = json.loads(path.read_text())
            assert data["step"] == int(path.name[4:7])
            assert data["reward"] in (0.0, 1.0)
            [branch] = data["branches"]
            [segment] = branch["segments"]
            # Two turns: the tool call, then the answer after the tool's result.
            assert [t["kind"] for t in segment["turns"]] == ["first", "extend"]
            assert segment["turns"][0]["finish_reason"] == "stop"

        # The shared engine has its original weights (and so its original logprobs) back.
        restored = original.prompt_logprobs(probe)
        assert max(abs(a - b) for a, b in zip(restored, before, strict=True)) < 1e-3
        original.close()
        assert http.get("/health").status_code == 200
