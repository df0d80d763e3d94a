"""The whole suite as `make test` runs it: every tier but two, then `tests/cluster` (its
fixture builds the images first, cached; then a real node), then the latency tiers (`ALONE`:
/healthz within 100 ms under attack, faults under load) with the machine to themselves.

Options given are passed to the two non-cluster runs (e.g. `--random-order-seed=N`). The exit
status is the first failing run's. `make test-cluster` still runs the cluster tier alone.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = "tests/cluster"
ALONE = ["tests/security", "tests/reliability"]


def pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-ra", *args]


def main(argv: list[str]) -> int:
    """One tier set after another: run beside the other tiers, the cluster tier's vLLM pods
    and the real-vLLM tiers' engines starved each other on 2 cores (an engine died, the API
    server timed out), so the order is serial until a side-by-side layout is shown safe."""
    started = time.monotonic()
    ignored = [f"--ignore={tier}" for tier in [CLUSTER, *ALONE]]
    rest = subprocess.run(pytest("--durations=25", *ignored, *argv), cwd=ROOT).returncode
    clustered = subprocess.run(pytest("-s", "--durations=10", CLUSTER), cwd=ROOT).returncode
    alone = subprocess.run(pytest("--durations=10", *ALONE, *argv), cwd=ROOT).returncode
    print(f"the whole suite took {time.monotonic() - started:.0f} s")
    return next((code for code in (rest, clustered, alone) if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
