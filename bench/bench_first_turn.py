"""First turns of a rollout step, measured on the real `tokenkeep serve` from outside: the
server CPU of one first turn at 1k / 32k / 128k tokens, and a GRPO-shaped burst (groups of
G rollouts that share their first message, all started at once) until the last rollout has
its first token.

The processes are bench/bench_served.py's (its helpers, not copies): the server, the instant
engine double in its own process (`bench_served.py --engine-double`), and this load
generator. Several servers run the same measurements one after the other, each fresh:
- `before`: the code of another checkout (`--before DIR`, e.g. main at its last commit),
  run from that folder with the same virtualenv;
- `no sharing`: this checkout with `TOKENKEEP_SHARED_TOKENS_BYTES=0` (every text tokenized
  each time: what item 1's changes alone give);
- `shared`: this checkout as it ships (`--shared-tokens-bytes` default).

First-turn CPU: one request at a time, each bracketed by the server's on-CPU time
(`Server.settled_cpu_ns`, /proc schedstat); `unique` is a first message no one sent before,
`group member` the same first message as the previous session (another rollout of its group).
Burst: `--groups` x `--group-size` first turns at once (one connection per rollout, bodies
built before the clock starts), streamed; the time until each rollout's first content chunk,
the server's CPU over the whole burst (/proc stat), statuses and errors.

Run: .venv/bin/python bench/bench_first_turn.py --before ../main [--out FILE] [--groups 512]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench_served's processes and tests/ helpers, shared

from bench.bench_served import (  # noqa: E402
    TICKS,
    Server,
    Texts,
    pct,
    report_out,
    start_server,
    stop,
)

SIZES = (1_000, 32_000, 128_000)
SYSTEM = "You are a coding agent. Fix the failing test in the repository below."


@dataclass
class Variant:
    name: str
    source: Path
    env: dict[str, str]


@dataclass
class FirstTurns:
    tokens: int
    prompt_tokens: int = 0
    unique_ms: list[float] = field(default_factory=list)
    member_ms: list[float] = field(default_factory=list)


@dataclass
class Burst:
    rollouts: int
    first_tokens: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    last_first_token_s: float = 0.0
    p50_first_token_s: float = 0.0
    server_cpu_s: float = 0.0


@dataclass
class Result:
    variant: Variant
    first: list[FirstTurns]
    burst: Burst | None


@contextlib.contextmanager
def environment(variant: Variant) -> Iterator[None]:
    """The server `start_server` launches inherits this process's environment: the variant's
    code first on PYTHONPATH and its settings, for as long as it starts."""
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = str(variant.source)
    os.environ.update(variant.env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def body(texts: Texts, tokens: int, stream: bool = False) -> bytes:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": texts.make(tokens)},
    ]
    return json.dumps(
        {"model": "tokenkeep-tiny-qwen3", "messages": messages, "stream": stream}
    ).encode()


def first_turns(server: Server, texts: Texts, tokens: int, samples: int, tag: str) -> FirstTurns:
    result = FirstTurns(tokens)
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=300) as client:
        for k in range(samples + 1):  # the first one warms the connection and the code
            payload = body(texts, tokens)  # the client's own work, outside the bracket
            for member, into in enumerate((result.unique_ms, result.member_ms)):
                url = server.chat(f"{tag}-{tokens}-{k}-{member}")
                before = server.settled_cpu_ns()
                response = client.post(url, content=payload, headers=headers)
                after = server.settled_cpu_ns()
                response.raise_for_status()
                result.prompt_tokens = response.json()["usage"]["prompt_tokens"]
                if k:
                    into.append((after - before) / 1e6)
    return result


async def burst(server: Server, texts: Texts, groups: int, size: int, tokens: int) -> Burst:
    payloads = [body(texts, tokens, stream=True) for _ in range(groups)]
    result = Burst(groups * size)
    timeout = httpx.Timeout(1800, connect=300, pool=1800)
    clients = [httpx.AsyncClient(timeout=timeout) for _ in range(result.rollouts)]
    firsts: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        ticks = server.cpu_ticks()
        started = time.perf_counter()

        async def rollout(index: int, client: httpx.AsyncClient) -> None:
            group, member = divmod(index, size)
            url = server.chat(f"burst-{group}-{member}")
            headers = {"content-type": "application/json"}
            try:
                async with client.stream(
                    "POST", url, content=payloads[group], headers=headers
                ) as response:
                    result.statuses[str(response.status_code)] += 1
                    first = None
                    async for line in response.aiter_lines():  # read to the end
                        if first is None and line.startswith("data: {") and '"content"' in line:
                            first = time.perf_counter() - started
                    if first is not None:
                        firsts.append(first)
                        result.first_tokens += 1
            except httpx.HTTPError as exc:
                result.errors[type(exc).__name__] += 1

        await asyncio.gather(*(rollout(i, c) for i, c in enumerate(clients)))
        result.server_cpu_s = (server.cpu_ticks() - ticks) / TICKS
    if firsts:
        result.last_first_token_s = max(firsts)
        result.p50_first_token_s = pct(firsts, 0.5)
    return result


def measure(variant: Variant, engine_url: str, workdir: Path, args: argparse.Namespace) -> Result:
    with environment(variant):
        server = start_server(engine_url, None, workdir)
    try:
        texts = Texts()
        first = [
            first_turns(server, texts, tokens, args.samples if tokens < 100_000 else 3, "first")
            for tokens in SIZES
        ]
        result = Result(variant, first, None)
        if args.groups:
            result.burst = asyncio.run(
                burst(server, texts, args.groups, args.group_size, args.burst_tokens)
            )
        return result
    finally:
        stop(server.proc)


def _commit(source: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def _described(variant: Variant) -> str:
    settings = " ".join(f"{k}={v}" for k, v in variant.env.items())
    where = f"`{variant.name}` = {variant.source.name} at {_commit(variant.source)}"
    return where + (f" with {settings}" if settings else "")


def report(results: list[Result], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    lines = [
        f"Run {now} on {platform.machine()}, CPython {platform.python_version()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.1f} at the end (shared machine: "
        "compare rows of this run, not absolute figures across runs).",
        "",
        "Variants: " + "; ".join(_described(r.variant) for r in results),
        "",
        f"First turn, server CPU ms per request (p50; {args.samples} samples, 3 at 128k; "
        "system prompt + one user message, Chat Completions, non-streaming):",
        "",
        "| first message | prompt tokens | "
        + " | ".join(f"{r.variant.name}: unique | {r.variant.name}: group member" for r in results)
        + " |",
        "|---|---|" + "---|---|" * len(results),
    ]  # fmt: skip
    for i, tokens in enumerate(SIZES):
        cells = " | ".join(
            f"{pct(r.first[i].unique_ms, 0.5):.1f} | {pct(r.first[i].member_ms, 0.5):.1f}"
            for r in results
        )
        lines.append(f"| {tokens // 1000}k | {results[0].first[i].prompt_tokens} | {cells} |")
    bursts = [(r.variant.name, r.burst) for r in results if r.burst is not None]
    if bursts:
        b0 = bursts[0][1]
        lines += [
            "",
            f"Burst: {args.groups} groups of {args.group_size} ({b0.rollouts} rollouts) with "
            f"{args.burst_tokens // 1000}k-token first messages, all started at once, streamed, "
            "one server process, one engine double:",
            "",
            "| variant | rollouts | got a first token | statuses | errors | last first token s "
            "| p50 first token s | server CPU s | server CPU ms per rollout |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, b in bursts:
            lines.append(
                f"| {name} | {b.rollouts} | {b.first_tokens} | {dict(b.statuses)} | "
                f"{dict(b.errors)} | {b.last_first_token_s:.1f} | {b.p50_first_token_s:.1f} | "
                f"{b.server_cpu_s:.1f} | {b.server_cpu_s * 1000 / b.rollouts:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout to compare (its code, this venv)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--samples", type=int, default=10, help="first turns per size")
    parser.add_argument("--groups", type=int, default=512, help="burst groups (0: no burst)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--burst-tokens", type=int, default=32_000)
    parser.add_argument("--variants", default="before,no sharing,shared")
    args = parser.parse_args()
    known = {
        "before": Variant("before", (args.before or ROOT).resolve(), {}),
        "no sharing": Variant("no sharing", ROOT, {"TOKENKEEP_SHARED_TOKENS_BYTES": "0"}),
        "shared": Variant("shared", ROOT, {}),
    }
    variants = [known[name] for name in args.variants.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="tokenkeep-bench-first-"))
    port_file = workdir / "engine-port"
    served = ROOT / "bench" / "bench_served.py"
    engine = subprocess.Popen([sys.executable, str(served), "--engine-double", str(port_file)])
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if engine.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("engine double did not start")
            time.sleep(0.1)
        engine_url = f"http://127.0.0.1:{port_file.read_text()}"
        results = [measure(v, engine_url, workdir, args) for v in variants]
    finally:
        stop(engine)
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(results, args)
    report_out(text, args.out)


if __name__ == "__main__":
    main()
