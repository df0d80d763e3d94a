"""The whole suite as `make test` runs it: every tier but two, then `tests/cluster` (its
fixture builds the images first, cached; then a real node), then the latency tiers (`ALONE`:
/healthz within 100 ms under attack, faults under load) with the machine to themselves.

Options given are passed to the two non-cluster runs (e.g. `--random-order-seed=N`). The exit
status is the first failing run's. `make test-cluster` still runs the cluster tier alone. The
last lines printed name every test that failed or errored, in any run, with the first lines of
its error: CI keeps the end of the output, and each run's own summary scrolls away under the
next run's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = "tests/cluster"
ALONE = ["tests/security", "tests/reliability"]


def pytest(report: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-ra", f"--junitxml={report}", *args]


def failures(report: Path, lines: int = 6) -> list[str]:
    """'FAILED|ERROR test id: first lines of the error' for each such test in a JUnit report
    (none if the run never wrote one: its own output says why)."""
    if not report.exists():
        return [f"no report from the run that was to write {report.name}: see its output above"]
    found = []
    for case in ET.parse(report).iter("testcase"):
        for outcome in ("failure", "error"):
            for problem in case.iter(outcome):
                test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
                text = (problem.get("message") or problem.text or "").strip().splitlines()
                found.append(f"{outcome.upper()} {test_id}: " + "\n    ".join(text[:lines]))
    return found


def main(argv: list[str]) -> int:
    """One tier set after another: run beside the other tiers, the cluster tier's vLLM pods
    and the real-vLLM tiers' engines starved each other on 2 cores (an engine died, the API
    server timed out), so the order is serial until a side-by-side layout is shown safe."""
    started = time.monotonic()
    ignored = [f"--ignore={tier}" for tier in [CLUSTER, *ALONE]]
    with tempfile.TemporaryDirectory(prefix="run_all-") as reports:
        runs = {
            "tiers": ["--durations=25", *ignored, *argv],
            "cluster tier": ["-s", "--durations=10", CLUSTER],
            "latency tiers": ["--durations=10", *ALONE, *argv],
        }
        codes, problems = {}, []
        for name, args in runs.items():
            report = Path(reports) / f"{name.replace(' ', '-')}.xml"
            codes[name] = subprocess.run(pytest(report, *args), cwd=ROOT).returncode
            if codes[name]:
                problems += [f"[{name}] {line}" for line in failures(report)]
    print(f"the whole suite took {time.monotonic() - started:.0f} s")
    print("exit codes: " + ", ".join(f"{name} {code}" for name, code in codes.items()))
    for line in problems:
        print(line)
    return next((code for code in codes.values() if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
