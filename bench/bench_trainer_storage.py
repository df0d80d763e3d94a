"""Storage cost of what the trainer needs: Redis bytes per stored token for agentic sessions
with policy versions (every turn), and with MoE routes (routing replay) for common MoE shapes.

Run: .venv/bin/python bench/bench_trainer_storage.py [--out bench/results/trainer_storage.md]
Starts its own redis-server on a free loopback port; well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import random
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis

from session_server.store.base import RoutedExperts, SessionMeta, TurnRecord, WeightSpan
from session_server.store.redis import RedisStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_store import Agentic  # the same agentic token shapes as bench_store.py
from redis_server import start_redis_server, stop_redis_server

# (name, MoE layers, experts per token, experts per layer)
SHAPES = [
    ("no routes", 0, 0, 0),
    ("Mixtral-8x7B-like: 32 layers, top-2 of 8", 32, 2, 8),
    ("Qwen3-30B-A3B-like: 48 layers, top-8 of 128", 48, 8, 128),
    ("DeepSeek-V3-like: 58 MoE layers, top-8 of 256", 58, 8, 256),
]
SEEDS = range(5)
TURNS = 30


def with_trainer_data(
    record: TurnRecord, start: int, layers: int, top_k: int, experts: int, rng: np.random.Generator
) -> TurnRecord:
    record.weight_versions = [WeightSpan("1042", 0, len(record.completion_ids))]
    if layers:
        # The positions this turn's request forwarded first: its parent's last sampled token
        # (or none for the first turn), its prompt delta, its completion but the last token.
        positions = len(record.prompt_delta) + len(record.completion_ids) - (start == 0)
        shape = (positions, layers, top_k)
        record.routed_experts = RoutedExperts(start, rng.integers(0, experts, shape))
    return record


async def session_bytes(
    store: RedisStore, raw: aioredis.Redis, seed: int, shape: tuple[str, int, int, int]
) -> tuple[int, int]:
    _, layers, top_k, experts = shape
    gen = Agentic(random.Random(seed))
    rng = np.random.default_rng(seed)
    sid = f"trainer-{seed}-{layers}-{top_k}"
    await store.create_session(SessionMeta(sid, time.time(), 3600, routed_experts=bool(layers)))
    parent, total = None, 0
    for _ in range(TURNS):
        record = with_trainer_data(gen.turn(parent), max(total - 1, 0), layers, top_k, experts, rng)
        (parent,) = await store.append_turns(sid, [record], [[gen.key(), gen.key()]])
        total += len(record.prompt_delta) + len(record.completion_ids)
    usage = sum([await raw.memory_usage(k, samples=0) or 0 for k in store.session_keys(sid)])
    return usage, total


async def run(url: str) -> list[str]:
    raw = aioredis.Redis.from_url(url)
    store = RedisStore(url, key_prefix="bench-trainer")
    lines = [
        "| routes | bytes per position (layers x top-k) | Redis bytes/token (mean of "
        f"{len(SEEDS)} sessions) | min | max |",
        "|---|---|---|---|---|",
    ]
    for shape in SHAPES:
        ratios = []
        for seed in SEEDS:
            usage, total = await session_bytes(store, raw, seed, shape)
            ratios.append(usage / total)
        lines.append(
            f"| {shape[0]} | {shape[1] * shape[2]} | **{statistics.mean(ratios):.2f}** "
            f"| {min(ratios):.2f} | {max(ratios):.2f} |"
        )
    await store.close()
    await raw.aclose()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/trainer_storage.md"))
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis_server(Path(tmp))
        try:
            lines = asyncio.run(run(url))
        finally:
            stop_redis_server(proc)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = [
        "# Storage of policy versions and MoE routes",
        "",
        "Produced by `bench/bench_trainer_storage.py`; numbers from one run.",
        "",
        f"- date: {now}; Python {platform.python_version()}, redis-py {version('redis')}",
        f"- {TURNS}-turn agentic sessions as in `bench_store.py` (prompt deltas 200-2000 tokens,"
        " completions 50-400 with float32 logprobs, two lookup keys per turn), every turn"
        " with its policy version; routes stored for every position (expert ids of up to 256"
        " experts take 1 byte). `MEMORY USAGE` over the session's keys / stored tokens.",
        "",
        *lines,
        "",
        "The packed record costs exactly layers x top-k bytes per position more than without"
        " routes; what Redis reports beyond that is its allocator rounding the larger hash"
        " values up to its size classes.",
        "",
        f"Whole run: {time.perf_counter() - started:.0f} s.",
    ]
    args.out.write_text("\n".join(report) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
