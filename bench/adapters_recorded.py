"""A recorded run of the SkyRL and slime adapters against the frameworks' own code, where the
test suite cannot install them (tests/integrations/test_adapters.py runs verl, AReaL and NeMo
Gym in CI): the same group of two rollouts as that test (a live server, the real Qwen3
tokenizer, the engine double sampling; a tool call across versions 3 -> 4, a one-turn
answer), exported and handed to the framework's types in a virtualenv built by hand
(bench/results/adapters.md says how), then checked equal to the export and to what the engine
was sent and sampled.

    python bench/adapters_recorded.py skyrl /tmp/skyrl-venv/bin/python
    python bench/adapters_recorded.py slime /tmp/slime-venv/bin/python --pythonpath /tmp/slime-src
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.engine_double import EngineDouble  # noqa: E402
from tests.harnesses.conftest import CONTEXT, live_stack  # noqa: E402
from tests.integrations.adapter_driver import type_name  # noqa: E402
from tests.integrations.slime_sample import Sample as StandIn  # noqa: E402
from tests.integrations.test_adapters import (  # noqa: E402
    DRIVER,
    GROUP,
    HELLO,
    WEATHER,
    Rollouts,
    expected,
    run_group,
)


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-6 for x, y in zip(a, b, strict=True))


def check_skyrl(result: dict[str, Any], rollouts: Rollouts, order: list[str]) -> list[str]:
    out, tensors, failures = result["output"], result["tensors"], []
    width = max(len(rollouts.rows[s].token_ids) for s in order)
    width_response = max(len(expected(rollouts, s)["response"]) for s in order)
    for i, session in enumerate(order):
        want = expected(rollouts, session)
        n, pad, rpad = (
            len(want["response"]),
            width - len(rollouts.rows[session].token_ids),
            width_response - len(want["response"]),
        )
        checks = {
            "prompt_token_ids": out["prompt_token_ids"][i] == want["prompt"],
            "response_ids": out["response_ids"][i] == want["response"],
            "loss_masks": out["loss_masks"][i] == want["mask"],
            "rollout_logprobs": close(out["rollout_logprobs"][i], want["logprobs"]),
            "rewards": out["rewards"][i] == want["reward"],
            # SkyRL's batch: left-padded sequences, right-aligned response tensors.
            "sequences": tensors["sequences"][i] == [0] * pad + want["prompt"] + want["response"],
            "attention_mask": tensors["attention_mask"][i] == [0] * pad + [1] * (width - pad),
            "response_mask": tensors["response_mask"][i] == [0] * rpad + [1] * n,
            "loss_masks tensor": tensors["loss_masks"][i] == [0] * rpad + want["mask"],
            "rollout_logprobs tensor": close(
                tensors["rollout_logprobs"][i], [0.0] * rpad + want["logprobs"]
            ),
            "rewards tensor": tensors["rewards"][i] == [0.0] * (rpad + n - 1) + [want["reward"]],
        }
        failures += [f"{session}: {name}" for name, ok in checks.items() if not ok]
    return failures


def check_slime(result: dict[str, Any], rollouts: Rollouts, order: list[str]) -> list[str]:
    failures = []
    for sample, session in zip(result["samples"], order, strict=True):
        want = expected(rollouts, session)
        spans = rollouts.rows[session].weight_versions
        checks = {
            "tokens": sample["tokens"] == want["prompt"] + want["response"],
            "response_length": sample["response_length"] == len(want["response"]),
            "loss_mask": sample["loss_mask"] == want["mask"],
            "rollout_log_probs": close(sample["rollout_log_probs"], want["logprobs"]),
            "reward": sample["reward"] == want["reward"],
            "status": sample["status"] == "COMPLETED",
            "session_id": sample["session_id"] == session,
            # slime appends one version per generate call: one per sampled span here.
            "weight_versions": sample["weight_versions"] == [s.version for s in spans],
        }
        failures += [f"{session}: {name}" for name, ok in checks.items() if not ok]
    # The stand-in the test suite uses must declare what slime declares, for what it has.
    stand_in = {f.name: type_name(f.type) for f in dataclasses.fields(StandIn)}
    for name, declared in stand_in.items():
        if result["fields"].get(name) != declared:
            failures.append(f"stand-in {name}: {declared}, slime's {result['fields'].get(name)}")
    if result["status_members"] != [m.name for m in StandIn.Status]:
        failures.append(f"stand-in Status members vs slime's {result['status_members']}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["skyrl", "slime"])
    parser.add_argument("python", help="the interpreter of the framework's virtualenv")
    parser.add_argument("--pythonpath", default="", help="where the framework's source is")
    args = parser.parse_args()
    double = EngineDouble(max_model_len=CONTEXT).start()
    try:
        with live_stack(double, []) as stack:
            rollouts = asyncio.run(run_group(stack))
            started = time.perf_counter()
            done = subprocess.run(
                [args.python, str(DRIVER), args.framework, rollouts.url, GROUP],
                capture_output=True, text=True, timeout=600, check=False,
                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": args.pythonpath,
                     "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"},
            )  # fmt: skip
            seconds = time.perf_counter() - started
    finally:
        double.stop()
    if done.returncode != 0:
        sys.exit(f"driver failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    order = result["session_ids"]
    assert sorted(order) == sorted([WEATHER, HELLO])
    check = {"skyrl": check_skyrl, "slime": check_slime}[args.framework]
    failures = check(result, rollouts, order)
    shown = {k: v for k, v in result.items() if k != "fields"}
    print(json.dumps(shown, indent=None)[:3000])
    print(f"driver: {seconds:.1f} s; sessions {order}")
    for session in order:
        want = expected(rollouts, session)
        print(
            f"{session}: prompt {len(want['prompt'])} tokens, response {len(want['response'])}"
            f" ({sum(want['mask'])} sampled), versions {rollouts.rows[session].versions}"
        )
    print("FAILED:\n  " + "\n  ".join(failures) if failures else "all checks equal")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
