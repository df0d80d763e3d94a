"""Side by side: the same conversations through tokenkeep, rllm-model-gateway and LiteLLM's
proxy, in front of the same instant engine, in one run.

Every system gets the same harness workload as `bench_served.py` (a system prompt, one big
first user message of 1k/8k/32k tokens, then turns that resend the whole history and add a
30-token user message; Chat Completions, non-streaming; a 7-token reply) and is measured the
same way from outside:

- the gateway process's own CPU per turn (`/proc/<pid>/task/*/schedstat` around each request,
  read until the process is idle, so work after the reply, such as logging, counts);
- the engine's CPU per turn, because the systems ask different work of it: tokenkeep sends
  token IDs to vLLM's token-in endpoint (`/inference/v1/generate`); rllm-model-gateway and
  LiteLLM forward the messages to `/v1/chat/completions`, where the engine renders the chat
  template over the whole history and tokenizes it again on every call. The engine here is
  the test double (`tests/engine_double.py`, in its own process: no real engine fits beside
  three gateways on this machine) with a chat route that does exactly that render + tokenize
  with the model's own template (transformers' `apply_chat_template`, as vLLM does), so its
  CPU per turn is the engine's share of the bill;
- the added latency: each turn's wall time through the gateway minus the same conversation
  sent straight to the engine's chat route (p50).

The peers are installed from PyPI into their own virtualenvs under `.cache/peers-*` (they
pin different dependency sets from tokenkeep's): `rllm-model-gateway` (its default SQLite
store and its in-memory one) and `litellm[proxy]` (no database).

Run: .venv/bin/python bench/bench_peers.py [--out bench/results/peers.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_served import (
    CONTEXT,
    REPLY_TEXT,
    ROOT,
    Server,
    Session,
    Texts,
    _free_port,
    new_session,
    pct,
    report_out,
    start_server,
    stop,
)

from tests.real_tokenizers import qwen3_dir

MODEL = "tokenkeep-tiny-qwen3"
HISTORIES = (1_000, 8_000, 32_000)
PEERS = ROOT / ".cache"
RLLM_VERSION = "0.1.0"
LITELLM_VERSION = "1.108.7"


# --- the engine: token route (the double as is) + a chat route that renders and tokenizes --


def _chat_engine_main(port_file: str) -> None:
    """Child process: the engine double, plus `/v1/chat/completions` as vLLM serves it
    (the model's chat template over the whole conversation, then tokenize)."""
    from collections import deque

    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
    from transformers import AutoTokenizer

    from tests.engine_double import EngineDouble, ScriptedCompletion

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_dir()))
    reply = [*tokenizer.encode(REPLY_TEXT, add_special_tokens=False)]
    reply.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    async def chat(request: Request) -> Response:
        body = await request.json()
        prompt = tokenizer.apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=True
        )
        if not isinstance(prompt, list):  # a BatchEncoding in newer transformers
            prompt = prompt["input_ids"]
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": REPLY_TEXT},
            "finish_reason": "stop",
            "logprobs": None,
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", MODEL),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(reply) - 1,
                "total_tokens": len(prompt) + len(reply) - 1,
            },
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {"token": f"token_id:{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                    for t in reply[:-1]
                ]
            }
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = list(prompt)
            choice["token_ids"] = reply[:-1]
        return JSONResponse(out)

    class ChatEngine(EngineDouble):
        def _app(self):  # type: ignore[no-untyped-def]
            app = super()._app()
            app.router.routes.append(Route("/v1/chat/completions", chat, methods=["POST"]))
            return app

    double = ChatEngine(max_model_len=CONTEXT)
    double.requests = deque(maxlen=1)  # type: ignore[assignment]
    double.default = lambda _prompt, _sampling: ScriptedCompletion(list(reply))
    double.start()
    Path(port_file).write_text(str(double.port))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    double.stop()


# --- the peers --------------------------------------------------------------------------


def _venv(name: str, requirement: str) -> Path:
    venv = PEERS / f"peers-{name}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", requirement], check=True)
    return venv


def _wait_up(proc: subprocess.Popen[bytes], url: str, log: Path, path: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n" + log.read_text()[-3000:])
        try:
            if httpx.get(url + path, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{url} did not start:\n" + log.read_text()[-3000:])


def start_rllm(engine_url: str, store: str, workdir: Path) -> Server:
    venv = _venv("rllm", f"rllm-model-gateway=={RLLM_VERSION}")
    port = _free_port()
    log = workdir / f"rllm-{store}.log"
    command = [
        str(venv / "bin" / "rllm-model-gateway"),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker", engine_url + "/v1",
        "--store", store,
        "--log-level", "warning",
    ]  # fmt: skip
    if store == "sqlite":
        command += ["--db-path", str(workdir / f"rllm-{port}.db")]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_up(proc, url, log, "/health")
    return Server(proc, url, log, "/sessions/{id}/v1/chat/completions")


def start_litellm(engine_url: str, workdir: Path) -> Server:
    venv = _venv("litellm", f"litellm[proxy]=={LITELLM_VERSION}")
    port = _free_port()
    log = workdir / "litellm.log"
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {engine_url}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    # No master key (LiteLLM then skips its auth per request: cheaper for it, on loopback).
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_MODE": "PRODUCTION",
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    command = [
        str(venv / "bin" / "litellm"),
        "--config", str(config),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--num_workers", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_up(proc, url, log, "/health/liveliness")
    return Server(proc, url, log, "/v1/chat/completions")


# --- measurement ------------------------------------------------------------------------


@dataclass
class Row:
    system: str
    history: int
    gateway_ms: list[float] = field(default_factory=list)
    engine_ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)
    first_turn_ms: float = 0.0


def measure(
    system: str, server: Server, engine: Server, texts: Texts, history: int, turns: int
) -> Row:
    """Sessions of `history` tokens through `server`; each measured turn is also sent
    straight to the engine's chat route (the direct baseline for the added latency)."""
    row = Row(system, history)
    group = [
        new_session(f"{system}-{history}-{i}-{time.time_ns()}", history, texts) for i in range(4)
    ]
    with httpx.Client(timeout=300) as client:

        def post(session: Session, url: str) -> dict[str, Any]:
            response = client.post(url, json=session.body(texts))
            response.raise_for_status()
            return response.json()

        for session in group:  # the first turn (the whole history is new): shown apart
            before = server.cpu_ns()
            reply = post(session, server.chat(session.id))
            row.first_turn_ms = max(row.first_turn_ms, (server.settled_cpu_ns() - before) / 1e6)
            session.answered(reply)
        session = group[0]
        session.answered(post(session, server.chat(session.id)))  # warm the paths
        for k in range(turns):
            session = group[k % len(group)]
            body = session.body(texts)
            g0, e0, t0 = server.cpu_ns(), engine.cpu_ns(), time.perf_counter()
            response = client.post(server.chat(session.id), json=body)
            t1 = time.perf_counter()
            g1, e1 = server.settled_cpu_ns(), engine.settled_cpu_ns()
            response.raise_for_status()
            reply = response.json()
            row.gateway_ms.append((g1 - g0) / 1e6)
            row.engine_ms.append((e1 - e0) / 1e6)
            row.wall_ms.append((t1 - t0) * 1000)
            direct = {**body, "messages": session.messages}
            t0 = time.perf_counter()
            client.post(engine.url + "/v1/chat/completions", json=direct).raise_for_status()
            row.direct_ms.append((time.perf_counter() - t0) * 1000)
            message = reply["choices"][0]["message"]
            session.messages.append({"role": "assistant", "content": message["content"]})
    return row


def report(rows: list[Row], turns: int) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Run {now} on {platform.machine()}, CPython {platform.python_version()}, "
        f"{os.cpu_count()} cores, load average "
        f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} at the end; {turns} measured turns "
        "per system and history (4 sessions), non-streaming Chat Completions, 7-token reply.",
        "",
        "| history | system | gateway CPU p50 ms | p95 | engine CPU p50 ms | gateway + engine "
        "p50 ms | vs tokenkeep (gateway / gateway + engine) | added latency p50 ms | "
        "first turn gateway CPU ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for history in sorted({r.history for r in rows}):
        group = [r for r in rows if r.history == history]
        base = next((r for r in group if r.system == "tokenkeep"), group[0])
        base_g = statistics.median(base.gateway_ms)
        base_t = statistics.median(
            g + e for g, e in zip(base.gateway_ms, base.engine_ms, strict=True)
        )
        for r in group:
            g = statistics.median(r.gateway_ms)
            total = statistics.median(a + b for a, b in zip(r.gateway_ms, r.engine_ms, strict=True))
            added = statistics.median(w - d for w, d in zip(r.wall_ms, r.direct_ms, strict=True))
            lines.append(
                f"| {history // 1000}k | {r.system} | {g:.2f} | {pct(r.gateway_ms, 0.95):.2f} | "
                f"{statistics.median(r.engine_ms):.2f} | {total:.2f} | "
                f"{g / base_g:.2f}x / {total / base_t:.2f}x | {added:.2f} | "
                f"{r.first_turn_ms:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-double", help=argparse.SUPPRESS)  # child process mode
    parser.add_argument("--out", type=Path)
    parser.add_argument("--turns", type=int, default=32, help="measured turns per history")
    parser.add_argument("--systems", default="tokenkeep,rllm-sqlite,rllm-memory,litellm")
    parser.add_argument("--histories", default=",".join(str(h) for h in HISTORIES))
    args = parser.parse_args()
    if args.engine_double:
        _chat_engine_main(args.engine_double)
        return
    workdir = Path(tempfile.mkdtemp(prefix="tokenkeep-bench-peers-"))
    port_file = workdir / "engine-port"
    engine_proc = subprocess.Popen([sys.executable, __file__, "--engine-double", str(port_file)])
    rows: list[Row] = []
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if engine_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("engine double did not start")
            time.sleep(0.1)
        engine = Server(engine_proc, f"http://127.0.0.1:{port_file.read_text()}", workdir)
        texts = Texts()
        histories = [int(h) for h in args.histories.split(",")]
        for system in args.systems.split(","):
            if system == "tokenkeep":
                server = start_server(engine.url, None, workdir)
            elif system.startswith("rllm-"):
                server = start_rllm(engine.url, system.removeprefix("rllm-"), workdir)
            elif system == "litellm":
                server = start_litellm(engine.url, workdir)
            else:
                raise SystemExit(f"unknown system {system}")
            try:
                for history in histories:
                    rows.append(measure(system, server, engine, texts, history, args.turns))
                    print(report(rows, args.turns), flush=True)
            except httpx.HTTPStatusError:
                print(server.log.read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                stop(server.proc)
    finally:
        stop(engine_proc)
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(rows, args.turns)
    report_out(text, args.out)


if __name__ == "__main__":
    main()
