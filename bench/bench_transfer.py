"""What tokenkeep adds to a weight-transfer publish (`{"source": {"transfer": {}}}`), per pause
mode: the control plane alone.

Two replicas of the vLLM transfer double (`tests/engine_double_transfer.py`: vLLM 0.32's RL
endpoints, answering at once; every vLLM transfer backend needs CUDA, so no real transfer
runs on this machine) behind one session server in this process (embedded store), and the
trainer's sequence of vLLM's `NCCLTrainerWeightTransferEngine` through `tk.policy_transfer()`
(start, update during the broadcast, finish). The engines and the broadcast cost ~nothing
here, so each publish's wall time is tokenkeep's overhead on top of a real transfer: three
trainer calls, each fanned out to every replica (pause + start; update; finish + cache +
checksum + resume), the store, HTTP. llm-d's experimental RL controller reports 520-600 ms
per step; the issue's target is <= 100 ms.

Run: .venv/bin/python bench/bench_transfer.py [--samples 20] [--out bench/results/transfer.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

from session_server.app import create_app
from session_server.settings import Settings
from tests.engine_double_transfer import DoubleTrainerEngine, NcclGroup, TransferEngineDouble
from tests.live_server import serving
from tests.session.conftest import qwen3_dir
from tokenkeep import Client
from tokenkeep.client import Pause

ADMIN_KEY = "bench-admin-key"
MODES: tuple[Pause, ...] = ("keep", "wait", "abort")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/transfer.md"))
    args = parser.parse_args()
    doubles = [TransferEngineDouble().start(), TransferEngineDouble().start()]
    settings = Settings(
        engine_urls=[d.url for d in doubles],
        model=doubles[0].model,
        tokenizer=str(qwen3_dir()),
        context_length=doubles[0].max_model_len,
        admin_key=ADMIN_KEY,
    )
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        with serving(create_app(settings)) as url, Client(url, api_key=ADMIN_KEY) as tk:
            transfer = tk.policy_transfer()
            group = NcclGroup("127.0.0.1", 29777, transfer.world_size())
            trainer = DoubleTrainerEngine.trainer_init(transfer, group)
            version = 0
            for sample in range(args.samples + 1):  # the first round warms up
                for mode in MODES:
                    version += 1
                    trainer.weights = f"step-{version}"
                    started = time.perf_counter()
                    tk.publish_policy(version, transfer=trainer, pause=mode)
                    if sample:
                        walls[mode].append(time.perf_counter() - started)
    finally:
        for double in doubles:
            double.stop()
    lines = [
        "# Weight-transfer publish: tokenkeep's control plane",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} CPUs (shared), {args.samples} publishes per mode, two replicas of "
        "the vLLM transfer double (instant engines and broadcast), one session server.",
        "Wall: `publish_policy(v, transfer=engine)` end to end (start, update, finish), i.e.",
        "what tokenkeep adds to the engines' own transfer. Target <= 100 ms (llm-d's",
        "experimental RL controller: 520-600 ms per step). An upper bound: the doubles and",
        "the trainer share this process (and its GIL) with the session server.",
        "",
        "| pause | median wall ms | p90 wall ms | max ms |",
        "|---|---|---|---|",
    ]
    for mode, values in walls.items():
        ordered = sorted(values)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        lines.append(
            f"| {mode} | {statistics.median(values) * 1000:.1f} | {p90 * 1000:.1f} | "
            f"{ordered[-1] * 1000:.1f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
