"""Issue 36 item 3, candidate (b) side by side: the HTTP front of the served turn.

The same turns (bench_served.py's sequential turns, server CPU per turn from schedstat,
until the server is idle) through five servers on one engine double, in one run, in
alternating order round after round (ABBA) so that the machine's load falls on all of them:

- `relay/uvicorn`: bench/floor_relay.py under uvicorn (uvloop, httptools): today's floor;
- `relay/granian`: the same app under granian (Rust HTTP/1.1, ASGI, one process);
- `relay/granian-rsgi`: the same relay on granian's own interface (RSGI: the body and the
  reply each in one call), the least a granian front could cost;
- `tokenkeep/uvicorn`: `tokenkeep serve` as users run it;
- `tokenkeep/granian`: the same command line with granian as the server
  (bench/front_granian.py).

Run: .venv/bin/python bench/bench_front.py [--rounds 2] [--turns 64] [--out FILE]
(granian must be importable: it is not a dependency, see bench/results/served.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_served as served

FRONT = Path(__file__).resolve().parent / "front_granian.py"


def _relay_granian(engine_url: str, workdir: Path, mode: str = "relay") -> served.Server:
    port = served._free_port()
    log = workdir / f"relay-granian-{port}.log"
    env = {**os.environ, "FLOOR_ENGINE": engine_url.removeprefix("http://")}
    proc = subprocess.Popen(
        [sys.executable, str(FRONT), mode, str(port)],
        cwd=served.ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return served._healthy(served.Server(proc, f"http://127.0.0.1:{port}", log), "relay", 60)


def _tokenkeep_granian(engine_url: str, workdir: Path) -> served.Server:
    port = served._free_port()
    log = workdir / f"tokenkeep-granian-{port}.log"
    command = [
        sys.executable, str(FRONT), "serve", "--",
        "--engine-url", engine_url,
        "--model", "tokenkeep-tiny-qwen3",
        "--tokenizer", str(served.qwen3_dir()),
        "--port", str(port),
        "--context-length", str(served.CONTEXT),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return served._healthy(served.Server(proc, f"http://127.0.0.1:{port}", log), "server", 120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=64, help="measured turns per history")
    parser.add_argument("--histories", default="1000,32000")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    histories = [int(h) for h in args.histories.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="tokenkeep-bench-front-"))
    port_file = workdir / "engine-port"
    engine = subprocess.Popen([sys.executable, served.__file__, "--engine-double", str(port_file)])
    starters: dict[str, Callable[[str, Path], served.Server]] = {
        "relay/uvicorn": served.start_floor_relay,
        "relay/granian": _relay_granian,
        "relay/granian-rsgi": lambda url, wd: _relay_granian(url, wd, "relay-rsgi"),
        "tokenkeep/uvicorn": lambda url, wd: served.start_server(url, None, wd),
        "tokenkeep/granian": _tokenkeep_granian,
    }
    cpu: dict[tuple[str, int], list[float]] = {}
    try:
        while not port_file.exists() or not port_file.read_text():
            if engine.poll() is not None:
                raise RuntimeError("engine double did not start")
            time.sleep(0.1)
        engine_url = f"http://127.0.0.1:{port_file.read_text()}"
        texts = served.Texts()
        for r in range(args.rounds):
            order = list(starters) if r % 2 == 0 else list(reversed(starters))
            for name in order:
                server = starters[name](engine_url, workdir)
                try:
                    tag = f"{name.replace('/', '-')}-{r}"  # a session id: no slash
                    for history in histories:
                        result = served.per_turn_cpu(
                            server, texts, history, args.sessions, args.turns, tag
                        )
                        cpu.setdefault((name, history), []).extend(result.cpu_ms)
                        print(name, history, f"p50 {statistics.median(result.cpu_ms):.2f} ms")
                finally:
                    served.stop(server.proc)
    finally:
        served.stop(engine)
        shutil.rmtree(workdir, ignore_errors=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
        f"CPython {platform.python_version()}, {os.cpu_count()} cores, {args.rounds} rounds "
        f"(ABBA) x {args.turns} turns per history, load average {load} at the end.",
        "",
        "| front | history | CPU p50 ms | CPU p95 ms | granian / uvicorn (p50) |",
        "|---|---|---|---|---|",
    ]
    for name in starters:
        for history in histories:
            values = cpu[(name, history)]
            p50 = statistics.median(values)
            ratio = ""
            if "granian" in name:
                base = statistics.median(cpu[(name.split("/")[0] + "/uvicorn", history)])
                ratio = f"{p50 / base:.2f}x"
            p95 = served.pct(values, 0.95)
            lines.append(f"| {name} | {history // 1000}k | {p50:.2f} | {p95:.2f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    served.report_out(text, args.out)


if __name__ == "__main__":
    main()
