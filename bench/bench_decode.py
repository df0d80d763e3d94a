"""Issue 36 item 3, candidate (a) side by side: decoding a steady turn's request body.

What the served path does today (`api/routing.py::LeanEndpoint`: pydantic-core validates the
JSON bytes into `ChatCompletionRequest`, then `api/chat.py::to_conversation` builds the
internal `Conversation`) against a compiled decoder of the same shape (msgspec Structs with
the request's fields and types), and orjson's plain parse as the least any decoder costs.
The bodies are bench_served.py's: a system prompt, a first user message of 1k / 32k tokens,
then 8 turns of a 30-token user message and the engine double's 7-token reply. CPU time per
call, interleaved repeats in one process, median of the repeats.

This bounds what decoding "straight into the internal form" could save on the served turn:
at most the validation and the conversion together (the internal form still has to be
built), against the served turn's ~2 ms (bench_front.py, served.md).

Run: .venv/bin/python bench/bench_decode.py [--out FILE]   (msgspec must be importable: it is
not a dependency, see bench/results/served.md)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import orjson
from pydantic import TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_served as served

from session_server.api.chat import ChatCompletionRequest, to_conversation


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(msgspec.Struct):
    function: FunctionCall
    id: str = ""
    type: str = "function"


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None


class ChatRequest(msgspec.Struct):
    messages: list[ChatMessageIn]
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    return_token_ids: bool | None = None


def _candidates(
    pydantic: TypeAdapter[ChatCompletionRequest],
    compiled: msgspec.json.Decoder[ChatRequest],
    raw: bytes,
) -> dict[str, Callable[[], object]]:
    validated = pydantic.validate_json(raw)
    assert compiled.decode(raw).messages[1].content == validated.messages[1].content
    return {
        "pydantic": lambda: pydantic.validate_json(raw),
        "convert": lambda: to_conversation(validated),
        "msgspec": lambda: compiled.decode(raw),
        "orjson": lambda: orjson.loads(raw),
    }


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    texts = served.Texts()
    pydantic = TypeAdapter(ChatCompletionRequest)
    compiled = msgspec.json.Decoder(ChatRequest)
    lines = [
        "| history | body kB | pydantic validate_json µs | to_conversation µs | "
        "msgspec decode µs | orjson loads µs | msgspec / pydantic |",
        "|---|---|---|---|---|---|---|",
    ]
    for history in (1_000, 32_000):
        session = served.new_session("decode", history, texts)
        for _ in range(8):
            session.body(texts)
            session.answered({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})
        raw = orjson.dumps(session.body(texts))
        candidates = _candidates(pydantic, compiled, raw)
        timings: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(args.repeats):
            for name, fn in candidates.items():
                timings[name].append(_per_call_us(fn, args.calls))
        us = {name: statistics.median(values) for name, values in timings.items()}
        lines.append(
            f"| {history // 1000}k | {len(raw) / 1000:.0f} | {us['pydantic']:.1f} | "
            f"{us['convert']:.1f} | {us['msgspec']:.1f} | {us['orjson']:.1f} | "
            f"{us['msgspec'] / us['pydantic']:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    served.report_out(text, args.out)


if __name__ == "__main__":
    main()
