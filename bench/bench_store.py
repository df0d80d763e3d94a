"""Store benchmark: Redis bytes per stored token, lookup latency (cold, and with the caller's
record cache), append latency.

Run: .venv/bin/python bench/bench_store.py [--out bench/results/store.md]
Starts its own redis-server (no persistence) on a free loopback port; about 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis

from session_server.store.base import RecordCache, SessionMeta, SessionStore, TurnRecord
from session_server.store.codec import encode_turn
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore

# The fixture's helper, shared rather than copied; tests/ is not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import start_redis_server, stop_redis_server

VOCAB = 151_936  # Qwen3
LATENCY_SAMPLES = 1000


@dataclass
class Agentic:
    """Token shapes of a tool-using agent: tool output prompt deltas, short completions."""

    rng: random.Random

    def turn(self, parent: int | None) -> TurnRecord:
        n_prompt = self.rng.randint(200, 2000)
        n_completion = self.rng.randint(50, 400)
        ids = np.random.default_rng(self.rng.getrandbits(32))
        # Logprobs as vLLM returns them: float32 values, mostly near 0.
        logprobs = (-ids.exponential(0.4, n_completion)).astype(np.float32)
        return TurnRecord(
            turn_id=0,
            parent_id=parent,
            segment_start=parent is None,
            kind="first" if parent is None else "extend",
            break_reason=None,
            prompt_delta=ids.integers(0, VOCAB, n_prompt).tolist(),
            completion_ids=ids.integers(0, VOCAB, n_completion).tolist(),
            logprobs=logprobs.tolist(),
            finish_reason="stop",
            stop_reason=151_645,
            n_messages=2 * (1 if parent is None else parent + 1),
            extra={"engine_ms": round(self.rng.uniform(50, 900), 1)},
        )

    def key(self) -> str:
        return f"{self.rng.getrandbits(128):032x}"


async def build_session(
    store: SessionStore, sid: str, gen: Agentic, turns: int | None = None, tokens: int | None = None
) -> tuple[list[str], int, list[TurnRecord]]:
    """A linear session of `turns` turns, or of turns until `tokens` stored tokens. Returns
    its reply keys, its stored token count and the records."""
    await store.create_session(
        SessionMeta(session_id=sid, created_at=time.time(), ttl_seconds=3600)
    )
    reply_keys: list[str] = []
    records: list[TurnRecord] = []
    parent = None
    total = 0
    while (turns is not None and len(records) < turns) or (tokens is not None and total < tokens):
        record = gen.turn(parent)
        room = None if tokens is None else tokens - total
        if room is not None and len(record.prompt_delta) + len(record.completion_ids) > room:
            # Trim the last turn so that the path holds exactly `tokens` tokens.
            n_completion = min(len(record.completion_ids), room // 5)
            record.completion_ids = record.completion_ids[:n_completion]
            record.logprobs = record.logprobs[:n_completion]
            record.prompt_delta = record.prompt_delta[: room - n_completion]
        reply_keys.append(gen.key())
        (parent,) = await store.append_turns(sid, [record], [[reply_keys[-1], gen.key()]])
        records.append(record)
        total += len(record.prompt_delta) + len(record.completion_ids)
    return reply_keys, total, records


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return statistics.median(ms), ms[int(0.95 * (len(ms) - 1))]


async def bytes_per_token(url: str) -> list[str]:
    raw = aioredis.Redis.from_url(url)
    store = RedisStore(url, key_prefix="bench-mem")
    lines = [
        "| session | turns | stored tokens | Redis bytes (MEMORY USAGE, all keys) | bytes/token "
        "| packed records only | as JSON lists |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios: list[float] = []
    for seed, turns in [*[(s, 30) for s in range(10)], (100, 60), (101, 120)]:
        sid = f"agentic-{seed}"
        _, total, records = await build_session(store, sid, Agentic(random.Random(seed)), turns)
        usage = sum(
            [await raw.memory_usage(key, samples=0) or 0 for key in store.session_keys(sid)]
        )
        packed = sum(len(encode_turn(r)) for r in records)
        as_json = sum(
            len(json.dumps(r.prompt_delta)) + len(json.dumps(r.completion_ids))
            + len(json.dumps(r.logprobs))
            for r in records
        )  # fmt: skip
        if turns == 30:
            ratios.append(usage / total)
        lines.append(
            f"| seed {seed} | {turns} | {total} | {usage} | **{usage / total:.2f}** "
            f"| {packed / total:.2f} | {as_json / total:.2f} |"
        )
    await store.close()
    await raw.aclose()
    summary = (
        f"30-turn sessions: bytes/token min {min(ratios):.2f}, mean "
        f"{statistics.mean(ratios):.2f}, max {max(ratios):.2f} (target <= 4.5)."
    )
    return [summary, "", *lines]


async def timed_lookups(
    store: SessionStore,
    sid: str,
    asked: list[str],
    input_key: str,
    caches: list[RecordCache | None],
) -> tuple[float, float]:
    """p50 and p95 of one lookup per cache given, sequential."""
    samples = []
    for known in caches:
        start = time.perf_counter()
        await store.lookup(sid, asked, input_key, known=known)
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


async def lookup_latency(store: SessionStore, label: str) -> list[str]:
    lines = []
    for history in (1_000, 8_000, 32_000):
        gen = Agentic(random.Random(history))
        sid = f"lookup-{history}"
        reply_keys, total, records = await build_session(store, sid, gen, tokens=history)
        # As the core asks: one reply key per earlier message (the assistant ones match),
        # the deepest last, and an input key that matches nothing.
        asked = [k for key in reply_keys for k in (gen.key(), key)]
        input_key = gen.key()
        warm = RecordCache()
        found = await store.lookup(sid, asked, input_key, known=warm)
        assert sum(len(r.prompt_delta) + len(r.completion_ids) for r in found.parent_path) == total
        # The next turn of a conversation: every record cached but the newest one.
        newest = found.parent_path[-1].turn_id
        all_but_newest = [
            RecordCache(warm.incarnation, {i: r for i, r in warm.records.items() if i != newest})
            for _ in range(LATENCY_SAMPLES)
        ]
        timings = [
            await timed_lookups(store, sid, asked, input_key, caches)
            for caches in ([None] * LATENCY_SAMPLES, [warm] * LATENCY_SAMPLES, all_but_newest)
        ]
        cells = " | ".join(f"{p50:.3f} | {p95:.3f}" for p50, p95 in timings)
        lines.append(f"| {label} | {total} | {len(records)} | {len(asked)} | {cells} |")
    return lines


async def append_latency(store: SessionStore, label: str) -> str:
    gen = Agentic(random.Random(7))
    sid = "append"
    await build_session(store, sid, gen, turns=1)
    turns = [gen.turn(1) for _ in range(LATENCY_SAMPLES)]
    samples = []
    for record in turns:
        keys = [[gen.key(), gen.key()]]
        start = time.perf_counter()
        await store.append_turns(sid, [record], keys)
        samples.append(time.perf_counter() - start)
    p50, p95 = percentiles(samples)
    mean_tokens = statistics.mean(len(t.prompt_delta) + len(t.completion_ids) for t in turns)
    return f"| {label} | {mean_tokens:.0f} | {p50:.3f} | {p95:.3f} |"


def machine() -> list[str]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    redis_version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[2]
    return [
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {cpu}, {os.cpu_count()} cores visible (shared), {platform.system()} "
        f"{platform.release()}",
        f"- Python {platform.python_version()}, redis-server {redis_version}, "
        f"redis-py {version('redis')}, hiredis {version('hiredis')}, numpy {version('numpy')}",
        "- Redis on loopback TCP, same machine as the client; the cores are shared with other "
        "work, so p95 carries its noise.",
    ]


async def main(out: Path) -> None:
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        proc, url = start_redis_server(Path(workdir))
        try:
            memory = await bytes_per_token(url)
            lookups: list[str] = []
            appends: list[str] = []
            for label, store in (
                ("memory", MemoryStore()),
                ("redis", RedisStore(url, key_prefix="bench-lat")),
            ):
                lookups += await lookup_latency(store, label)
                appends.append(await append_latency(store, label))
                await store.close()
        finally:
            stop_redis_server(proc)
    report = [
        "# Store benchmark",
        "",
        "Produced by `bench/bench_store.py`; numbers from one run.",
        "",
        *machine(),
        "",
        "## (a) Redis memory per stored token",
        "",
        "Agentic sessions: prompt deltas of 200-2000 tokens (tool output), completions of "
        "50-400 tokens with float32 logprobs, Qwen3 vocabulary (3-byte IDs), two 32-char "
        "lookup keys per turn. `MEMORY USAGE` summed over the session's keys, divided by the "
        "tokens stored (prompt deltas + completions). 'packed records only' is the codec "
        "output without Redis overhead; 'as JSON lists' is what the same tokens and logprobs "
        "cost as JSON text, for comparison.",
        "",
        *memory,
        "",
        "## (b) Lookup latency, cold and with a record cache",
        "",
        f"One `lookup` of a linear session whose matched path holds the given tokens, "
        f"returning TurnRecords (Python lists); {LATENCY_SAMPLES} calls per column, "
        f"sequential. The reply keys asked for are two per turn (one that misses, one that "
        f"hits), plus an input key that misses. *cold*: no `known` cache, every record on the "
        f"path is transferred and decoded. *warm*: `known=` a RecordCache holding the whole "
        f"path (nothing transferred or decoded). *all but newest*: the cache lacks the "
        f"path's last record, as on the next turn of a conversation (one record decoded).",
        "",
        "| store | path tokens | path turns | reply keys asked | cold p50 ms | cold p95 ms "
        "| warm p50 ms | warm p95 ms | all but newest p50 ms | all but newest p95 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *lookups,
        "",
        "## (c) Append latency",
        "",
        f"`append_turns` of one agentic turn with two keys, encode included; {LATENCY_SAMPLES} "
        f"sequential calls on one session.",
        "",
        "| store | mean tokens per turn | p50 ms | p95 ms |",
        "|---|---|---|---|",
        *appends,
        "",
        f"Whole run: {time.monotonic() - began:.0f} s.",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "store.md"
    )
    asyncio.run(main(parser.parse_args().out))
