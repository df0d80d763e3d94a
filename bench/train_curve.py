"""The reward curve of `tokenkeep demo --train`, recorded: runs the demo (or reads a recorded
`--json` output), writes bench/results/train_curve.jsonl, train_curve.png and train.md.

    .venv/bin/python bench/train_curve.py --steps 30 --group-size 8
    .venv/bin/python bench/train_curve.py --from /tmp/run.jsonl   # plot a recorded run

The plot needs matplotlib (`pip install matplotlib`; not a tokenkeep dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def plot(lines: list[dict[str, Any]], summary: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [line["step"] for line in lines]
    rewards = [line["mean_reward"] for line in lines]
    window = 5
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    ax.plot(steps, rewards, "o", ms=3, alpha=0.5, label="mean reward of the step's group")
    ax.plot(steps, smooth, "-", lw=2, label=f"{window}-step mean")
    ax.axhline(summary["chance_reward"], ls="--", c="gray", lw=1, label="chance (random policy)")
    ax.set_xlabel("GRPO step (= policy version loaded into the running vLLM)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(
        f"tokenkeep demo --train: tiny Qwen3 on vLLM CPU, G={summary['group_size']}", fontsize=10
    )
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--from", dest="source", type=Path, help="a recorded --json output")
    args = parser.parse_args(argv)
    if args.source:
        text = args.source.read_text()
    else:
        command = [
            str(Path(sys.executable).with_name("tokenkeep")),
            "demo",
            "--train",
            "--json",
            "--steps",
            str(args.steps),
            "--group-size",
            str(args.group_size),
        ]
        text = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    lines = [r for r in records if "step" in r]
    [summary] = [r["summary"] for r in records if "summary" in r]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_curve.jsonl").write_text(text)
    plot(lines, summary, RESULTS / "train_curve.png")
    print(json.dumps(summary, indent=2))
    print(f"load average now: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
