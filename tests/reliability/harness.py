"""Processes and load for the reliability tier: real redis-server (AOF, fsync always), real
`tokenkeep serve` processes, engine doubles as processes, all on loopback; a client that
drives multi-turn chat sessions over HTTP the way a rollout harness does, and the checks
against what Redis holds afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from session_server.store.redis import RedisStore
from tests.real_tokenizers import qwen3_dir
from tests.redis_server import _free_loopback_port, start_redis_server, stop_redis_server

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "reliability.md"
# Statuses the server documents for transient faults; anything else 4xx/5xx is a failure.
DOCUMENTED = {429, 503}
MODEL = "tokenkeep-tiny-qwen3"  # the engine double's


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


class Redis:
    """A redis-server with AOF and fsync always: an acknowledged write survives kill -9."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc, self.url = start_redis_server(workdir, args=self._args())
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    @staticmethod
    def _args() -> list[str]:
        return ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.proc, _ = start_redis_server(self.workdir, port=self.port, args=self._args())

    def stop(self) -> None:
        stop_redis_server(self.proc)


class Engine:
    """An engine double process (tests/reliability/engine_proc.py). Construct several, then
    `ready()` each: they start side by side."""

    def __init__(self, latency_ms: float = 20, chunk_ms: float = 5) -> None:
        self.port = _free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.engine_proc", "--port", str(self.port),
             "--latency-ms", str(latency_ms), "--chunk-ms", str(chunk_ms)],
            cwd=REPO, stdout=subprocess.DEVNULL,
        )  # fmt: skip

    def ready(self) -> Engine:
        _wait_http(self.url + "/health", self.proc)
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class Server:
    """`tokenkeep serve` as its own process; its log (one JSON line per request) is kept.
    Construct several, then `ready()` each: they start side by side. `ready` also sends one
    warm-up turn (the first turn of a process loads the chat template and renderer)."""

    def __init__(self, workdir: Path, redis_url: str, engines: list[str], *flags: str) -> None:
        self.port = _free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"serve-{self.port}.log"
        args = [sys.executable, "-m", "session_server.cli", "serve", "--port", str(self.port),
                "--redis-url", redis_url, "--tokenizer", str(qwen3_dir()), "--model", MODEL,
                *(a for url in engines for a in ("--engine-url", url)), *flags]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "TOKENKEEP_LOG_LEVEL": "info"},
            )  # fmt: skip

    def ready(self) -> Server:
        _wait_http(self.url + "/readyz", self.proc)
        warm = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        response = httpx.post(
            f"{self.url}/sessions/warmup-{self.port}/v1/chat/completions", json=warm, timeout=120
        )
        response.raise_for_status()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Tally:
    requests: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    """Transport failures (no HTTP answer) per server URL."""
    latencies: list[float] = field(default_factory=list)
    acked: dict[str, list[tuple[int, list[int]]]] = field(default_factory=dict)
    """Session -> acknowledged turns in order: (turn id, completion token ids)."""
    unfinished: int = 0
    """Sessions that gave up (a turn never went through within the retries)."""
    failures: list[tuple[str, float, str]] = field(default_factory=list)
    """(server URL, time.monotonic() the request was sent, status or 'dropped') of every
    request that was not answered 200."""

    def p95_ms(self) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1000, 1)

    def undocumented(self) -> dict[str, int]:
        """Answers other than 200, the documented 429/503, and in-band stream errors (the
        documented outcome of a failure after a stream's first byte)."""
        return {
            s: n
            for s, n in self.statuses.items()
            if s != "200"
            and not (s.isdigit() and int(s) in DOCUMENTED)
            and not s.startswith("stream_error:")
        }


async def _turn(
    client: httpx.AsyncClient, url: str, session: str, messages: list[dict[str, Any]],
    stream: bool,
) -> tuple[str, dict[str, Any] | None, float | None]:  # fmt: skip
    """One request: (status or 'stream_error', the reply body, Retry-After)."""
    # The sampled tokens come back to be checked against the stored trajectory later.
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 64,
        "return_token_ids": True,
    }
    if stream:  # the last chunk, with usage, names the stored turn
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    path = f"{url}/sessions/{session}/v1/chat/completions"
    if not stream:
        response = await client.post(path, json=body)
        retry = response.headers.get("retry-after")
        return str(response.status_code), response.json(), float(retry) if retry else None
    async with client.stream("POST", path, json=body) as response:
        retry = response.headers.get("retry-after")
        if response.status_code != 200:
            await response.aread()
            return str(response.status_code), None, float(retry) if retry else None
        content, turn_ids, token_ids = "", None, []
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"stream_error:{chunk['error'].get('code')}", None, None
            for choice in chunk.get("choices", ()):
                content += choice.get("delta", {}).get("content") or ""
                token_ids += choice.get("token_ids") or []
            turn_ids = (chunk.get("tokenkeep") or {}).get("turn_ids") or turn_ids
        if turn_ids is None:
            return "stream_error:none", None, None
        return "200", {
            "choices": [{"message": {"role": "assistant", "content": content},
                         "token_ids": token_ids}],
            "tokenkeep": {"turn_ids": turn_ids},
        }, None  # fmt: skip


async def drive(
    urls: list[str],
    *,
    sessions: int,
    turns: int,
    prefix: str,
    stream_every: int = 0,
    attempts: int = 30,
    tally: Tally | None = None,
) -> Tally:
    """`sessions` concurrent sessions of `turns` turns each; turn i of a session goes to
    urls[i % len(urls)], and a request that gets no answer or a documented 429/503 is sent
    again (to the next URL after a dropped connection, after Retry-After otherwise), as a
    harness with retries does. Every `stream_every`-th session streams."""
    tally = tally or Tally()
    limits = httpx.Limits(max_connections=sessions * 2, max_keepalive_connections=sessions * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(n: int) -> None:
            session = f"{prefix}-{n}"
            stream = bool(stream_every) and n % stream_every == 0
            messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
            acked = tally.acked.setdefault(session, [])
            target = n
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Step {turn} of task {n}."})
                target += 1
                for _ in range(attempts):
                    url = urls[target % len(urls)]
                    started = time.perf_counter()
                    sent_at = time.monotonic()
                    tally.requests += 1
                    try:
                        status, reply, retry_after = await _turn(
                            client, url, session, messages, stream
                        )
                    except httpx.TransportError as exc:
                        tally.dropped[url] += 1
                        tally.failures.append((url, sent_at, f"dropped: {exc!r}"))
                        target += 1
                        await asyncio.sleep(0.2)
                        continue
                    tally.statuses[status] += 1
                    if status != "200":
                        tally.failures.append((url, sent_at, status))
                    if status == "200" and reply is not None:
                        tally.latencies.append(time.perf_counter() - started)
                        choice = reply["choices"][0]
                        acked.append((reply["tokenkeep"]["turn_ids"][0], choice["token_ids"]))
                        messages.append(
                            {"role": "assistant", "content": choice["message"]["content"]}
                        )
                        break
                    if not (status.startswith("stream_error") or int(status) in DOCUMENTED):
                        tally.unfinished += 1
                        return
                    await asyncio.sleep(retry_after or 0.2)
                else:
                    tally.unfinished += 1
                    return

        await asyncio.gather(*(one(n) for n in range(sessions)))
    return tally


async def check_store(redis_url: str, tally: Tally) -> tuple[int, int]:
    """(lost acknowledged turns, corrupted sessions) judged from what Redis holds: an
    acknowledged turn is lost if its id is missing or holds other tokens; a session is
    corrupted if the stored path of an acknowledged turn (its parent chain) does not hold,
    turn by turn, exactly the completions the client was acknowledged before it, in one
    segment. (The path may run through a sibling of an acknowledged turn: a turn stored by a
    replica that died before answering, retried elsewhere, with the very same tokens.)"""
    store = RedisStore(redis_url)
    lost = corrupted = 0
    try:
        for session, acked in tally.acked.items():
            if not acked:
                continue
            records = {r.turn_id: r for r in await store.all_turns(session)}
            broken = False
            for position, (turn_id, tokens) in enumerate(acked):
                record = records.get(turn_id)
                if record is None or record.completion_ids != tokens:
                    lost += 1
                    broken = True
                    continue
                path = [record]
                while path[-1].parent_id is not None and path[-1].parent_id in records:
                    path.append(records[path[-1].parent_id])
                path.reverse()
                seen = [r.completion_ids for r in path]
                expected = [t for _, t in acked[: position + 1]]
                if seen != expected or any(r.segment_start for r in path[1:]):
                    print(  # what a failing run needs to be understood
                        f"corrupted {session}: turn {turn_id}: path "
                        f"{[r.turn_id for r in path]}, acked {[t for t, _ in acked]}"
                    )
                    broken = True
            corrupted += broken
    finally:
        await store.close()
    return lost, corrupted


def record(fault: str, tally: Tally, lost: int, corrupted: int, note: str = "") -> None:
    """Add (or replace) this fault's row in bench/results/reliability.md, when asked to
    (`TOKENKEEP_RECORD_RESULTS=1`): an ordinary test run leaves the recorded figures alone."""
    if os.environ.get("TOKENKEEP_RECORD_RESULTS") != "1":
        return
    header = (
        "| fault | requests | answers by status | dropped connections | lost acked turns "
        "| corrupted sessions | p95 ms | note |\n|---|---|---|---|---|---|---|---|\n"
    )
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))
    dropped = ", ".join(f"{u.rsplit(':', 1)[1]}: {n}" for u, n in tally.dropped.items()) or "0"
    row = (
        f"| {fault} | {tally.requests} | {statuses} | {dropped} | {lost} | {corrupted} "
        f"| {tally.p95_ms()} | {note} |\n"
    )
    text = RESULTS.read_text() if RESULTS.exists() else ""
    if header not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + header
    lines = [line for line in text.splitlines(keepends=True) if not line.startswith(f"| {fault} |")]
    # The row goes at the end of the table, which other sections may follow.
    end = len(text[: text.index(header)].splitlines()) + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines.insert(end, row)
    RESULTS.write_text("".join(lines))
