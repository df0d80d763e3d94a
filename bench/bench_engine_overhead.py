"""What the engine client adds on top of a bare HTTP call to the token endpoint.

The engine is the vLLM-protocol double (tests/engine_double.py) in its own process, so the
numbers measure the client (request building, rendezvous, SSE parsing), not a model. Each case
runs the same requests through a bare `httpx.AsyncClient` and through `EngineClient`; loopback
numbers include the double's own time and the machine's noise, so `stream_parse_in_memory`
also measures the client's SSE handling alone, from memory. The loopback cases go through the
client's own HTTP/1.1 connection (`engine_http.py`), as served turns do; the in-memory case
through httpx (a transport handed to `EngineClient` takes httpx's path), which changes the
bare read, not the SSE handling measured on top of it.

    .venv/bin/python bench/bench_engine_overhead.py   # writes bench/results/engine_overhead.json
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from session_server.engine_replicas import rendezvous_order  # noqa: E402
from session_server.engines import EngineClient  # noqa: E402

PROMPT = list(range(1000, 3000))  # a 2000-token spliced prompt
SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 4096}
SHORT, LONG = 16, 512  # completion lengths
ROUNDS = 200


def serve_double(port_out: Any, completion_len: int) -> None:
    from tests.engine_double import EngineDouble, ScriptedCompletion

    tokens = [*range(5000, 5000 + completion_len - 1), 151645]
    double = EngineDouble()
    double.default = lambda _prompt, _sampling: ScriptedCompletion(tokens)
    double.start()
    port_out.put(double.port)
    while True:
        time.sleep(3600)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


async def measure(url: str, stream: bool) -> tuple[list[float], list[float]]:
    """Alternates one bare request and one client request, so drift (the machine's load, the
    double's growing request log) hits both sides alike."""
    body = {
        "token_ids": PROMPT,
        "sampling_params": {**SAMPLING, "logprobs": 0},
        "return_token_ids": True,
        "stream": stream,
    }
    bare_times: list[float] = []
    client_times: list[float] = []
    async with (
        httpx.AsyncClient() as http,
        EngineClient([url], model="tokenkeep-tiny-qwen3", health_interval_s=3600) as client,
    ):
        for i in range(ROUNDS + 10):
            started = time.perf_counter()
            if stream:
                async with http.stream("POST", url + "/inference/v1/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            json.loads(line[5:])
            else:
                json.loads((await http.post(url + "/inference/v1/generate", json=body)).content)
            middle = time.perf_counter()
            if stream:
                async for _event in client.stream(f"s{i}", PROMPT, SAMPLING):
                    pass
            else:
                await client.generate(f"s{i}", PROMPT, SAMPLING)
            if i >= 10:  # warm-up
                bare_times.append(middle - started)
                client_times.append(time.perf_counter() - middle)
    return bare_times, client_times


def run_case(completion_len: int, stream: bool) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    port_out = ctx.Queue()
    process = ctx.Process(target=serve_double, args=(port_out, completion_len), daemon=True)
    process.start()
    try:
        url = f"http://127.0.0.1:{port_out.get(timeout=30)}"
        bare_times, client_times = asyncio.run(measure(url, stream))
    finally:
        process.kill()
        process.join()
    bare_stats, client_stats = percentiles(bare_times), percentiles(client_times)
    return {
        "mode": "stream" if stream else "generate",
        "prompt_tokens": len(PROMPT),
        "completion_tokens": completion_len,
        "bare_httpx": bare_stats,
        "engine_client": client_stats,
        "overhead_p50_ms": round(client_stats["p50_ms"] - bare_stats["p50_ms"], 3),
    }


async def parse_cost(completion_len: int) -> dict[str, float]:
    """Client cost alone: a recorded-shape SSE body served from memory (no sockets, no server),
    read bare (lines + json.loads) and through EngineClient.stream."""
    from tests.engine_double import ScriptedCompletion, _generate_chunks

    tokens = [*range(5000, 5000 + completion_len - 1), 151645]
    chunks = _generate_chunks("r", PROMPT, [ScriptedCompletion(tokens)], want_logprobs=True)
    sse = ("".join(chunks) + "data: [DONE]\n\n").encode()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    transport = httpx.MockTransport(handler)
    rounds = 50
    async with httpx.AsyncClient(transport=transport) as http:
        started = time.perf_counter()
        for _ in range(rounds):
            async with http.stream("POST", "http://engine/inference/v1/generate", json={}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        json.loads(line[5:])
        bare_s = (time.perf_counter() - started) / rounds
    async with EngineClient(["http://engine"], model="m", transport=transport) as c:
        started = time.perf_counter()
        for _ in range(rounds):
            async for _event in c.stream("s", PROMPT, SAMPLING):
                pass
        client_s = (time.perf_counter() - started) / rounds
    return {
        "completion_tokens": completion_len,
        "bare_ms": round(bare_s * 1000, 3),
        "engine_client_ms": round(client_s * 1000, 3),
        "client_us_per_token": round((client_s - bare_s) / completion_len * 1e6, 2),
    }


def rendezvous_cost(replicas: int) -> float:
    urls = [f"http://engine-{i}:8000" for i in range(replicas)]
    started = time.perf_counter()
    for i in range(10000):
        rendezvous_order(f"session-{i}", urls)
    return round((time.perf_counter() - started) / 10000 * 1e6, 2)


def main() -> None:
    cases = [run_case(n, stream) for n in (SHORT, LONG) for stream in (False, True)]
    result = {
        "benchmark": "engine client overhead over a bare HTTP call (double engine, loopback)",
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "rounds": ROUNDS,
        "cases": cases,
        "stream_parse_in_memory": asyncio.run(parse_cost(LONG)),
        "rendezvous_order_us": {n: rendezvous_cost(n) for n in (2, 8, 32)},
    }
    out = ROOT / "bench" / "results" / "engine_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
