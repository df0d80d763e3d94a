"""What a trainer pays for `POST /policy`, per pause mode, on real vLLM CPU replicas.

Two replicas of the tiny Qwen3 (started for publishing: dev mode, the tokenkeep_vllm
extension, an engine key) behind one session server in this process (embedded store), and
checkpoints perturbed from the tiny model. Each sample publishes the other checkpoint while
one streamed turn is in flight on each replica's sessions (so `keep` has something to freeze,
`wait` something to wait for, `abort` something to end), and records:
- wall: the trainer's `publish_policy` call, end to end over HTTP;
- pause: how long the replicas were paused (the server's `pause_seconds`);
- per replica: its seconds and each step's (pause; reload; cache, version and checksum);
- control-plane overhead: wall minus the slowest replica's reload step (the engine's own
  work of loading weights; with `wait`, plus the time its pause waited for the turn in
  flight), i.e. everything tokenkeep adds around the reload (the checkpoint check, the
  other engine calls, the store, HTTP). llm-d's experimental RL controller reports
  520-600 ms per step; the issue's target is <= 100 ms.

Run: .venv/bin/python bench/bench_publish.py [--samples 5] [--out bench/results/publish.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from session_server.app import create_app
from session_server.devtools import localengine
from session_server.settings import Settings
from tests.checkpoints import perturbed
from tests.live_server import serving
from tokenkeep import Client

ENGINE_KEY = "bench-engine-key"
MODES = ("keep", "wait", "abort")


def in_flight(session: dict[str, Any], max_tokens: int) -> threading.Thread:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
        "stream": True,
    }

    def run() -> None:
        headers = {"authorization": f"Bearer {session['api_key']}"}
        url = session["openai_base_url"] + "/chat/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as response:
            for _ in response.iter_bytes():
                pass

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5, help="publishes per pause mode")
    parser.add_argument("--out", type=Path, default=Path("bench/results/publish.md"))
    args = parser.parse_args()

    model_dir = localengine.build_model()
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as work:
        checkpoints = [perturbed(model_dir, Path(work) / f"step-{n}", n) for n in (1, 2)]
        engines = [localengine.start(dev_mode=True, engine_key=ENGINE_KEY) for _ in range(2)]
        try:
            settings = Settings(
                engine_urls=[e.url for e in engines],
                model=engines[0].served_model_name,
                tokenizer=str(model_dir),
                context_length=engines[0].max_model_len,
                engine_key=ENGINE_KEY,
            )
            rows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            with serving(create_app(settings)) as url, Client(url) as tk:
                version = 0
                for sample in range(args.samples):
                    for mode in MODES:
                        threads = []
                        for _ in range(2):
                            info = httpx.post(f"{url}/sessions", json={}, timeout=60).json()
                            threads.append(in_flight(info, 48))
                        time.sleep(1.0)  # the turns are being sampled
                        version += 1
                        started = time.perf_counter()
                        policy = tk.publish_policy(
                            version, path=str(checkpoints[version % 2]), pause=mode
                        )
                        wall = time.perf_counter() - started
                        for thread in threads:
                            thread.join(300)
                        replicas = policy.replicas
                        reload_s = max(r.steps.get("reload", 0.0) for r in replicas)
                        # `wait` pauses as long as the turn in flight still generates.
                        waited = [r.steps.get("pause", 0.0) for r in replicas]
                        engine_s = max(
                            r.steps.get("reload", 0.0)
                            + (r.steps.get("pause", 0.0) if mode == "wait" else 0.0)
                            for r in replicas
                        )
                        rows[mode].append(
                            {
                                "wall": wall,
                                "pause": policy.pause_seconds or 0.0,
                                "replica": [r.seconds or 0.0 for r in replicas],
                                "reload": reload_s,
                                "overhead": wall - engine_s,
                                "waited": max(waited) if mode == "wait" else 0.0,
                                "steps": [r.steps for r in replicas],
                                "requests": sum(policy.requests.values()),
                            }
                        )
                        print(
                            f"[bench] {mode:5s} sample {sample}: wall {wall:.3f}s pause "
                            f"{policy.pause_seconds:.3f}s reload {reload_s:.3f}s in flight "
                            f"{sum(policy.requests.values())}",
                            flush=True,
                        )
        finally:
            for engine in engines:
                engine.stop()
    write(args.out, rows, args.samples)
    return 0


def write(out: Path, rows: dict[str, list[dict[str, Any]]], samples: int) -> None:
    load = os.getloadavg()[0]
    lines = [
        "# POST /policy on real vLLM CPU replicas (bench/bench_publish.py)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{load:.1f} at the end; two tiny-Qwen3 replicas (tied embeddings), one session "
        f"server, {samples} publishes per mode, one streamed turn in flight per replica at "
        "each publish. Medians.",
        "",
        "| mode | wall (trainer's call) | pause | per replica | engine reload (slowest) "
        "| control-plane overhead | in-flight requests |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, samples_of in rows.items():
        per_replica = [s for row in samples_of for s in row["replica"]]
        lines.append(
            f"| {mode} | {median([r['wall'] for r in samples_of]):.3f} s "
            f"| {median([r['pause'] for r in samples_of]):.3f} s "
            f"| {median(per_replica):.3f} s "
            f"| {median([r['reload'] for r in samples_of]):.3f} s "
            f"| {median([r['overhead'] for r in samples_of]) * 1000:.0f} ms "
            f"| {median([float(r['requests']) for r in samples_of]):.0f} |"
        )
    steps = [s for rows_of in rows.values() for row in rows_of for s in row["steps"]]
    names = sorted({name for s in steps for name in s})
    lines += [
        "",
        "Engine steps, median seconds over every replica and mode: "
        + ", ".join(f"{n} {median([s[n] for s in steps if n in s]):.3f}" for n in names)
        + ".",
        "",
        "The control-plane overhead is the trainer's wall time minus the slowest replica's "
        "reload step (with `wait`, also minus the time its pause waited for the turn in "
        "flight): the checkpoint check, the pause, cache, version, checksum and resume calls, "
        "the store and HTTP.",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
