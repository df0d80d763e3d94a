"""The whole served request: `tokenkeep serve` as a user runs it, measured from outside.

Three processes: the real server (`tokenkeep serve`, uvicorn, default log level), an instant
engine (tests/engine_double.py, the vLLM-protocol test double: a real model would make the
engine's time dominate and hide the server's), and this load generator. The figure that
matters is the server process's own CPU time, read from /proc:

- per turn (p50/p95): one request at a time, each bracketed by the server's on-CPU time
  (`/proc/<pid>/task/*/schedstat`, nanoseconds, read again until the server is idle: the
  access log line and metrics after the reply count) — a harness that resends the whole history
  (system prompt + one big first message of 1k/32k/128k tokens + the turns so far) and adds a
  30-token user message; the engine answers 7 tokens at once;
- turns/s per core: many sessions at once, total turns / server CPU seconds (`/proc/<pid>/stat`);
- a burst: 4,096 sessions start at once against one engine and one server, two turns each:
  every turn answered, errors, connections closed without a response, engine marked down,
  and what one queued request costs (peak resident memory over the idle server's, divided by
  the peak number of requests waiting for a slot, read from /metrics during the burst);
- added time to first token: a streamed turn through tokenkeep (first content chunk) minus
  the same-length token prompt streamed straight to the engine double (its first chunk);
- the floor: the same sequential turns through `bench/floor_relay.py`, a minimal Python relay
  under the same server stack with no session logic, so that figures from machines of
  different speeds can be compared (tokenkeep's CPU per turn as a multiple of it).

Run: .venv/bin/python bench/bench_served.py [--out bench/results/served.md] [--quick]
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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # tests/ helpers, shared rather than copied

from tests.real_tokenizers import qwen3_dir  # noqa: E402
from tests.redis_server import start_redis_server, stop_redis_server  # noqa: E402

HISTORIES = (1_000, 32_000, 128_000)
NEW_MESSAGE_TOKENS = 30
REPLY_TEXT = "All done, the tests pass now."  # 7 tokens + end of turn (Qwen3)
CONTEXT = 262_144
TICKS = os.sysconf("SC_CLK_TCK")


# --- processes --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _engine_double_main(port_file: str) -> None:
    """Child process: an engine double that answers every request with REPLY_TEXT."""
    from collections import deque

    from tokenizers import Tokenizer

    from tests.engine_double import EngineDouble, ScriptedCompletion

    tokenizer = Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json"))
    reply = [*tokenizer.encode(REPLY_TEXT, add_special_tokens=False).ids]
    reply.append(tokenizer.token_to_id("<|im_end|>"))
    double = EngineDouble(max_model_len=CONTEXT)
    double.requests = deque(maxlen=1)  # type: ignore[assignment]  # keep no 128k-token bodies
    double.default = lambda _prompt, _sampling: ScriptedCompletion(list(reply))
    double.start()
    Path(port_file).write_text(str(double.port))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    double.stop()


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    chat_path: str = "/sessions/{id}/v1/chat/completions"

    def chat(self, session_id: str) -> str:
        return self.url + self.chat_path.format(id=session_id)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_ticks(self) -> int:
        """utime + stime of the whole process (all threads, live and exited)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    def cpu_ns(self) -> int:
        """On-CPU nanoseconds of the live threads (fine-grained, for one request)."""
        total = 0
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += int((task / "schedstat").read_text().split()[0])
        return total

    def settled_cpu_ns(self, limit_s: float = 0.05) -> int:
        """`cpu_ns` once the process has stopped working: what it does after the reply has
        left (the access log line, metrics) belongs to the turn too, and a client that has
        read the reply can get here before the server has done it."""
        now = self.cpu_ns()
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            time.sleep(0.001)
            later = self.cpu_ns()
            if later == now:
                break
            now = later
        return now

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def marked_down(self) -> int:
        log = self.log.read_text(errors="replace")
        return log.count("marked down") + log.count("is now down")


def start_server(engine_url: str, redis_url: str | None, workdir: Path) -> Server:
    port = _free_port()
    log = workdir / f"server-{port}.log"
    command = [
        str(Path(sys.executable).parent / "tokenkeep"),
        "serve",
        "--engine-url", engine_url,
        "--model", "tokenkeep-tiny-qwen3",
        "--tokenizer", str(qwen3_dir()),
        "--port", str(port),
        "--context-length", str(CONTEXT),
    ]  # fmt: skip
    if redis_url:
        command += ["--redis-url", redis_url]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return _healthy(Server(proc, f"http://127.0.0.1:{port}", log), "server", 120)


def _healthy(server: Server, what: str, timeout_s: float) -> Server:
    """`server` once its /healthz answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited:\n" + server.log.read_text()[-3000:])
        try:
            if httpx.get(server.url + "/healthz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.proc.kill()
    raise RuntimeError(f"{what} did not start")


def start_floor_relay(engine_url: str, workdir: Path) -> Server:
    """bench/floor_relay.py under the same server stack as `tokenkeep serve`."""
    port = _free_port()
    log = workdir / f"floor-{port}.log"
    command = [
        sys.executable, "-m", "uvicorn", "bench.floor_relay:app", "--port", str(port),
        "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "FLOOR_ENGINE": engine_url.removeprefix("http://")}
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    return _healthy(Server(proc, f"http://127.0.0.1:{port}", log), "floor relay", 60)


def floor_per_turn(engine_url: str, workdir: Path, args: argparse.Namespace) -> list[PerTurn]:
    texts = Texts()
    relay = start_floor_relay(engine_url, workdir)
    try:
        return [
            per_turn_cpu(relay, texts, h, args.sessions, args.turns, "floor") for h in HISTORIES[:2]
        ]
    finally:
        stop(relay.proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


# --- conversations ----------------------------------------------------------------------


class Texts:
    """Text of an exact token length (Qwen3 tokenizer), different for every call."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json"))
        self.count = 0

    def make(self, tokens: int) -> str:
        self.count += 1
        words = " ".join(f"item{self.count}_{k} is fine" for k in range(tokens // 2 + 8))
        ids = self.tokenizer.encode(words, add_special_tokens=False).ids[:tokens]
        return self.tokenizer.decode(ids)


@dataclass
class Session:
    id: str
    messages: list[dict[str, Any]]

    def body(self, texts: Texts, stream: bool = False) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": texts.make(NEW_MESSAGE_TOKENS)})
        return {"model": "tokenkeep-tiny-qwen3", "messages": self.messages, "stream": stream}

    def answered(self, reply: dict[str, Any]) -> None:
        self.messages.append(reply["choices"][0]["message"])


def new_session(name: str, history: int, texts: Texts) -> Session:
    return Session(
        name,
        [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": texts.make(history)},
            {"role": "assistant", "content": "Noted."},
        ],
    )


def chat_url(server: Server, session: Session) -> str:
    return server.chat(session.id)


def turn(client: httpx.Client, server: Server, session: Session, texts: Texts) -> dict[str, Any]:
    response = client.post(chat_url(server, session), json=session.body(texts))
    response.raise_for_status()
    reply = response.json()
    session.answered(reply)
    return reply


# --- measurements -----------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class PerTurn:
    history: int
    prompt_tokens: int
    cpu_ms: list[float] = field(default_factory=list)
    mean_ms: float = 0.0


def per_turn_cpu(
    server: Server,
    texts: Texts,
    history: int,
    sessions: int,
    turns: int,
    tag: str,
    stream: bool = False,
) -> PerTurn:
    """Sequential turns; each one's server CPU from schedstat; the mean from /proc/stat.
    `stream`: the measured turns are streamed (read to the end inside the bracket)."""
    group = [new_session(f"{tag}-h{history}-{i}", history, texts) for i in range(sessions)]
    result = PerTurn(history, 0)
    with httpx.Client(timeout=120) as client:
        for session in group:  # the first turn renders the whole history: not measured
            turn(client, server, session, texts)
        for _ in range(2):  # warm the connection and the code paths
            turn(client, server, group[0], texts)
        ticks = server.cpu_ticks()
        for k in range(turns):
            session = group[k % sessions]
            body = session.body(texts, stream=stream)
            payload = json.dumps(body).encode()  # the client's own work, outside the bracket
            before = server.cpu_ns()
            request = client.build_request(
                "POST",
                chat_url(server, session),
                content=payload,
                headers={"content-type": "application/json"},
            )
            response = client.send(request, stream=True)
            raw = response.read()
            after = server.settled_cpu_ns()
            response.raise_for_status()
            if stream:
                lines = [json.loads(line[6:]) for line in raw.splitlines() if line[6:7] == b"{"]
                text = "".join(
                    c["delta"].get("content") or "" for line in lines for c in line["choices"]
                )
                session.messages.append({"role": "assistant", "content": text})
            else:
                reply = json.loads(raw)
                session.answered(reply)
                result.prompt_tokens = reply["usage"]["prompt_tokens"]
            result.cpu_ms.append((after - before) / 1e6)
        result.mean_ms = (server.cpu_ticks() - ticks) / TICKS * 1000 / turns
    return result


async def _measured_turns(
    group: list[Session], turns: int, one: Callable[[Session], Awaitable[None]]
) -> int:
    """`turns` more turns of every session in `group` at once; the number that failed."""
    errors = 0

    async def run(session: Session) -> None:
        nonlocal errors
        for _ in range(turns):
            try:
                await one(session)
            except httpx.HTTPError:
                errors += 1

    await asyncio.gather(*(run(s) for s in group))
    return errors


async def concurrent_turns(
    server: Server, texts: Texts, history: int, sessions: int, turns: int, tag: str
) -> tuple[float, float, int]:
    """`sessions` at once, `turns` each: (turns per server CPU second, wall turns/s, errors)."""
    group = [new_session(f"{tag}-c{history}-{i}", history, texts) for i in range(sessions)]
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(session: Session) -> None:
            response = await client.post(chat_url(server, session), json=session.body(texts))
            response.raise_for_status()
            session.answered(response.json())

        await asyncio.gather(*(one(s) for s in group))  # first turns: not measured
        ticks = server.cpu_ticks()
        started = time.perf_counter()

        errors = await _measured_turns(group, turns, one)
        wall = time.perf_counter() - started
        cpu = (server.cpu_ticks() - ticks) / TICKS
    done = sessions * turns - errors
    return done / cpu, done / wall, errors


@dataclass
class Burst:
    sessions: int
    turns: int = 0
    answered: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    closed: int = 0
    other_errors: Counter[str] = field(default_factory=Counter)
    marked_down: int = 0
    wall_s: float = 0.0
    peak_queued: int = 0
    rss_idle: int = 0
    rss_peak: int = 0

    @property
    def per_queued_kib(self) -> float:
        return (self.rss_peak - self.rss_idle) / max(1, self.peak_queued) / 1024


async def _queued(client: httpx.AsyncClient, server: Server) -> int:
    text = (await client.get(server.url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("tokenkeep_queued_requests "):
            return int(float(line.split()[1]))
    return 0


async def burst(server: Server, texts: Texts, sessions: int, turns: int) -> Burst:
    """All sessions start at once (an RL step launching its rollouts), `turns` turns each."""
    group = [new_session(f"burst-{i}", 300, texts) for i in range(sessions)]
    result = Burst(sessions, sessions * turns)
    marked_before = server.marked_down()
    timeout = httpx.Timeout(900, connect=120, pool=900)
    result.rss_idle = server.rss_bytes()
    started = time.perf_counter()
    # One client (one connection) per rollout, as rollout workers have: a single httpx pool
    # of 4,096 connections spends O(connections) per request and became the bottleneck.
    clients = [httpx.AsyncClient(timeout=timeout) for _ in group]
    async with contextlib.AsyncExitStack() as stack:
        for c in clients:
            await stack.enter_async_context(c)
        done = asyncio.Event()

        async def sample() -> None:
            async with httpx.AsyncClient(timeout=60) as probe:
                while not done.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        result.peak_queued = max(result.peak_queued, await _queued(probe, server))
                    result.rss_peak = max(result.rss_peak, server.rss_bytes())
                    await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample())

        async def run(session: Session, client: httpx.AsyncClient) -> None:
            for _ in range(turns):
                try:
                    response = await client.post(
                        chat_url(server, session), json=session.body(texts)
                    )
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    result.closed += 1
                    result.other_errors[type(exc).__name__] += 1
                    return
                except httpx.HTTPError as exc:
                    result.other_errors[type(exc).__name__] += 1
                    return
                result.statuses[str(response.status_code)] += 1
                if response.status_code != 200:
                    return
                result.answered += 1
                session.answered(response.json())

        await asyncio.gather(*(run(s, c) for s, c in zip(group, clients, strict=True)))
        done.set()
        await sampler
    result.wall_s = time.perf_counter() - started
    result.marked_down = server.marked_down() - marked_before
    return result


@dataclass
class ScaleOut:
    processes: int
    turns: int
    wall_s: float
    server_cpu_s: list[float]
    redis_cpu_s: float
    errors: int

    @property
    def per_cpu_second(self) -> float:
        return self.turns / sum(self.server_cpu_s)

    @property
    def redis_ms_per_turn(self) -> float:
        return self.redis_cpu_s * 1000 / self.turns


def _ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def scale_out(
    servers: list[Server], redis_pid: int, texts: Texts, sessions: int, turns: int
) -> ScaleOut:
    """`sessions` at once, each turn sent to the next server round robin (no affinity: any
    process continues any session from Redis), 1k-token histories."""
    group = [new_session(f"scale{len(servers)}-{i}", 1_000, texts) for i in range(sessions)]
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    turn_no = 0
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(session: Session) -> None:
            nonlocal turn_no
            server = servers[turn_no % len(servers)]
            turn_no += 1
            response = await client.post(chat_url(server, session), json=session.body(texts))
            response.raise_for_status()
            session.answered(response.json())

        await asyncio.gather(*(one(s) for s in group))  # first turns: not measured
        before = [s.cpu_ticks() for s in servers]
        redis_before = _ticks(redis_pid)
        started = time.perf_counter()

        errors = await _measured_turns(group, turns, one)
        wall = time.perf_counter() - started
        cpu = [(s.cpu_ticks() - b) / TICKS for s, b in zip(servers, before, strict=True)]
        redis_cpu = (_ticks(redis_pid) - redis_before) / TICKS
    return ScaleOut(len(servers), sessions * turns - errors, wall, cpu, redis_cpu, errors)


def run_scale_out(engine_url: str, workdir: Path, counts: list[int]) -> str:
    texts = Texts()
    rows = []
    for count in counts:
        redis_proc, redis_url = start_redis_server(workdir)
        servers = [start_server(engine_url, redis_url, workdir) for _ in range(count)]
        try:
            rows.append(asyncio.run(scale_out(servers, redis_proc.pid, texts, 32, 8)))
        finally:
            for server in servers:
                stop(server.proc)
            stop_redis_server(redis_proc)
    lines = [
        "Scale-out on one Redis (32 sessions at once, 8 turns each, 1k-token histories, each "
        "turn to the next process round robin):",
        "",
        "| processes | turns | wall turns/s | turns per server CPU second (each process) | "
        "server CPU ms per turn | Redis CPU ms per turn | processes for 10,000 turns/s at one "
        "core each | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = " / ".join(f"{r.turns / r.processes / c:.0f}" for c in r.server_cpu_s)
        lines.append(
            f"| {r.processes} | {r.turns} | {r.turns / r.wall_s:.0f} | {each} | "
            f"{1000 / r.per_cpu_second:.2f} | {r.redis_ms_per_turn:.3f} | "
            f"{10_000 / r.per_cpu_second:.0f} | {r.errors} |"
        )
    return "\n".join(lines) + "\n"


def added_ttft(
    server: Server, engine_url: str, texts: Texts, history: int, samples: int
) -> tuple[float, float, float]:
    """(tokenkeep TTFT p50, engine-double TTFT p50, paired added p50) in ms."""
    session = new_session(f"ttft-h{history}", history, texts)
    ours: list[float] = []
    theirs: list[float] = []
    with httpx.Client(timeout=120) as client:
        reply = turn(client, server, session, texts)
        prompt = [1000 + (k % 5000) for k in range(reply["usage"]["prompt_tokens"] + 40)]
        engine_body = {
            "model": "tokenkeep-tiny-qwen3",
            "token_ids": prompt,
            "sampling_params": {"max_tokens": 16, "logprobs": 0},
            "return_token_ids": True,
            "stream": True,
        }
        for _ in range(samples + 2):
            body = session.body(texts, stream=True)
            started = time.perf_counter()
            first = None
            content: list[str] = []
            with client.stream("POST", chat_url(server, session), json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", ()):
                        text = choice.get("delta", {}).get("content")
                        if text:
                            first = first or time.perf_counter()
                            content.append(text)
            ours.append((first or time.perf_counter()) - started)
            session.messages.append({"role": "assistant", "content": "".join(content)})
            started = time.perf_counter()
            first = None
            with client.stream(
                "POST", engine_url + "/inference/v1/generate", json=engine_body
            ) as response:
                for line in response.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter()
            theirs.append((first or time.perf_counter()) - started)
    ours, theirs = ours[2:], theirs[2:]
    added = [(a - b) * 1000 for a, b in zip(ours, theirs, strict=True)]
    return (
        statistics.median(ours) * 1000,
        statistics.median(theirs) * 1000,
        statistics.median(added),
    )


# --- report -----------------------------------------------------------------------------


def run_store(
    store: str, engine_url: str, redis_url: str | None, workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    texts = Texts()
    server = start_server(engine_url, redis_url, workdir)
    out: dict[str, Any] = {"store": store}
    try:
        out["per_turn"] = [
            per_turn_cpu(server, texts, h, args.sessions, args.turns, store) for h in HISTORIES
        ]
        out["streamed"] = [
            per_turn_cpu(server, texts, h, args.sessions, args.turns, store + "-s", stream=True)
            for h in (1_000, 32_000)
        ]
        out["throughput"] = {
            h: asyncio.run(concurrent_turns(server, texts, h, args.concurrency, 6, store))
            for h in (1_000, 32_000)
        }
        out["ttft"] = {
            h: added_ttft(server, engine_url, texts, h, args.ttft)
            for h in ((1_000, 32_000) if args.ttft else ())
        }
        if args.burst and (store == "memory" or args.burst_redis):
            out["burst"] = asyncio.run(burst(server, texts, args.burst, 2))
    finally:
        stop(server.proc)
    return out


def report(
    results: list[dict[str, Any]], label: str, concurrency: int, floor: list[PerTurn]
) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## {label}",
        "",
        f"Run {now} on {platform.machine()}, CPython {platform.python_version()}, "
        f"{os.cpu_count()} cores, load average "
        f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (absolute figures are "
        "noisy; compare rows of one run).",
        "",
        "Server CPU per turn (sequential turns, 30-token user message, 7-token reply):",
        "",
        "| store | history | prompt tokens | CPU p50 ms | CPU p95 ms | CPU mean ms | 128k/1k p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = statistics.median(r["per_turn"][0].cpu_ms)
        for p in r["per_turn"]:
            p50 = statistics.median(p.cpu_ms)
            ratio = f"{p50 / base:.2f}x" if p.history == HISTORIES[-1] else ""
            lines.append(
                f"| {r['store']} | {p.history // 1000}k | {p.prompt_tokens} | {p50:.2f} | "
                f"{pct(p.cpu_ms, 0.95):.2f} | {p.mean_ms:.2f} | {ratio} |"
            )
    if floor:
        lines += [
            "",
            "The floor on this machine: the same turns through `bench/floor_relay.py`, a minimal "
            "Python relay under the same server stack (uvicorn, uvloop, httptools; request read, "
            "token prompt of the same length sent to the same engine double, fixed reply), no "
            "session logic. Scale the absolute figures by it on another machine:",
            "",
            "| history | relay CPU p50 ms | tokenkeep (first store) p50 ms | tokenkeep / relay |",
            "|---|---|---|---|",
        ]
        for relay in floor:
            ours = next(p for p in results[0]["per_turn"] if p.history == relay.history)
            theirs, mine = statistics.median(relay.cpu_ms), statistics.median(ours.cpu_ms)
            lines.append(
                f"| {relay.history // 1000}k | {theirs:.2f} | {mine:.2f} | {mine / theirs:.1f}x |"
            )
    lines += [
        "",
        "Streamed turns (`stream: true`, read to the end), server CPU per turn:",
        "",
        "| store | history | streamed CPU p50 ms | non-streamed p50 ms | streaming adds ms |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for p in r.get("streamed", ()):
            whole = next(q for q in r["per_turn"] if q.history == p.history)
            ours, theirs = statistics.median(p.cpu_ms), statistics.median(whole.cpu_ms)
            lines.append(
                f"| {r['store']} | {p.history // 1000}k | {ours:.2f} | {theirs:.2f} | "
                f"{ours - theirs:+.2f} |"
            )
    lines += [
        "",
        f"Throughput ({concurrency} sessions at once, 6 turns each):",
        "",
        "| store | history | turns per server CPU second | wall turns/s | errors |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for h, (per_core, wall, errors) in r["throughput"].items():
            lines.append(
                f"| {r['store']} | {h // 1000}k | {per_core:.0f} | {wall:.0f} | {errors} |"
            )
    lines += [
        "",
        "Added time to first token, streaming (p50 ms, paired):",
        "",
        "| store | history | through tokenkeep | engine double alone | added |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for h, (ours, theirs, added) in r["ttft"].items():
            lines.append(
                f"| {r['store']} | {h // 1000}k | {ours:.2f} | {theirs:.2f} | {added:.2f} |"
            )
    lines += [
        "",
        "Burst (all sessions start at once, 2 turns each, one engine, one server):",
        "",
        "| store | sessions | turns | answered 200 | statuses | closed without response | "
        "other errors | engine marked down | wall s | peak queued | RSS idle / peak MiB | "
        "KiB per queued request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b: Burst | None = r.get("burst")
        if b is None:
            continue
        lines.append(
            f"| {r['store']} | {b.sessions} | {b.turns} | {b.answered} | "
            f"{dict(b.statuses)} | {b.closed} | {dict(b.other_errors) or 0} | "
            f"{b.marked_down} | {b.wall_s:.1f} | {b.peak_queued} | "
            f"{b.rss_idle / 2**20:.0f} / {b.rss_peak / 2**20:.0f} | {b.per_queued_kib:.1f} |"
        )
    return "\n".join(lines) + "\n"


def report_out(text: str, out: Path | None) -> None:
    """Print a report, and append it to the results file `out` names (if any)."""
    print(text)
    if out:
        with out.open("a") as fh:
            fh.write("\n" + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-double", help=argparse.SUPPRESS)  # child process mode
    parser.add_argument("--out", type=Path)
    parser.add_argument("--label", default="tokenkeep serve")
    parser.add_argument("--stores", default="memory,redis")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=96, help="measured turns per history")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--ttft", type=int, default=30, help="streamed turns per history (0: skip)")
    parser.add_argument("--burst", type=int, default=4096, help="sessions (0: skip)")
    parser.add_argument("--burst-redis", action="store_true")
    parser.add_argument("--no-floor", action="store_true", help="skip the minimal-relay floor")
    parser.add_argument(
        "--scale-out", default="", help="process counts on one Redis, e.g. 1,2,4 (only this)"
    )
    args = parser.parse_args()
    if args.engine_double:
        _engine_double_main(args.engine_double)
        return
    workdir = Path(tempfile.mkdtemp(prefix="tokenkeep-bench-served-"))
    port_file = workdir / "engine-port"
    engine = subprocess.Popen([sys.executable, __file__, "--engine-double", str(port_file)])
    redis_proc = None
    results = []
    floor: list[PerTurn] = []
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if engine.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("engine double did not start")
            time.sleep(0.1)
        engine_url = f"http://127.0.0.1:{port_file.read_text()}"
        if args.scale_out:
            text = run_scale_out(engine_url, workdir, [int(n) for n in args.scale_out.split(",")])
            report_out(text, args.out)
            return
        for store in args.stores.split(","):
            redis_url = None
            if store == "redis":
                redis_proc, redis_url = start_redis_server(workdir)
            try:
                results.append(run_store(store, engine_url, redis_url, workdir, args))
            finally:
                if redis_proc is not None:
                    stop_redis_server(redis_proc)
                    redis_proc = None
        if not args.no_floor:
            floor = floor_per_turn(engine_url, workdir, args)
    finally:
        stop(engine)
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(results, args.label, args.concurrency, floor)
    report_out(text, args.out)


if __name__ == "__main__":
    main()
