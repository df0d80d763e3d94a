"""Per-turn overhead of the session server versus a full re-render, side by side.

For a tool-using Qwen3 conversation with 1k, 8k and 32k tokens of history, one run measures:
- tokenkeep: everything the session server does per turn besides generating — lineage
  lookup, classification, splice with proof, sampling merge, serialising the engine request,
  and storing the new turn — against the embedded store and against a real Redis;
- re-render: the chat template over the whole history plus tokenization (what a server that
  re-tokenizes does per turn), with the same tokenizer, on the same machine, in the same run.

The engine is not involved (its time is the model's); the bench calls the service's own
planning and recording steps and the engine client's own body encoder.

Run: .venv/bin/python bench/bench_turn_overhead.py [--out bench/results/turn_overhead.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from session_server.conversation import Conversation, Message, Tool, ToolCall
from session_server.engines import Call, EngineClient, encode_body
from session_server.metrics import Metrics
from session_server.service_config import ServiceConfig
from session_server.splice import ChatModel
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore
from session_server.tokenizer import load_tokenizer
from session_server.turns.recording import Sampled
from session_server.turns.service import TurnService

# tests/ helpers, shared rather than copied.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.real_tokenizers import qwen3_dir
from tests.redis_server import start_redis_server, stop_redis_server

SIZES = (1_000, 8_000, 32_000)
NEW_MESSAGE_TOKENS = (30, 1000)
"""Size of the tool result each measured turn adds: tokenizing it is work proportional to
the new content, not to the history, so both are reported."""
SAMPLES = 200
TOOLS = [Tool("read_file", "Read a file.", {"type": "object", "properties": {"path": {}}})]


def _tool_output(model: ChatModel, index: int, tokens: int) -> str:
    text = f"# file {index}\n" + " ".join(f"line{index}_{k} = value{k}" for k in range(tokens))
    ids = model.encode(text)[:tokens]
    return model.decode(ids)


async def _grow(
    service: TurnService, model: ChatModel, session_id: str, target: int
) -> list[Message]:
    """Store turns (a tool call, ~1k tokens of tool output) until the history reaches
    `target` tokens; returns the messages a harness would send for the next turn."""
    messages = [Message("system", "You are a coding agent."), Message("user", "Fix the bug.")]
    turn = 0
    while True:
        conversation = Conversation(messages=list(messages), tools=TOOLS)
        plan = await service.planner.plan(session_id, conversation)
        if len(plan.prompt_ids) >= target:
            return messages
        args = f'{{"path": "src/module_{turn}.py"}}'
        call_text = f'<tool_call>\n{{"name": "read_file", "arguments": {args}}}\n</tool_call>'
        completion = [*model.encode(call_text), model.stop_token_ids[0]]
        await _store_turn(service, model, plan, conversation, completion)
        call = ToolCall(f"call_{turn}", "read_file", args)
        messages += [
            Message("assistant", "", tool_calls=[call]),
            Message("tool", _tool_output(model, turn, 1000), tool_call_id=call.id),
        ]
        turn += 1


async def _store_turn(
    service: TurnService,
    model: ChatModel,
    plan: Any,
    conversation: Conversation,
    completion: list[int],
) -> None:
    """What the service does after generation: parse the sampled tokens, store the turn."""
    reply = model.parse(completion, "stop", plan.prompt_ids, TOOLS)
    sampled = Sampled(
        0, completion, [-0.1] * len(completion), "stop", None, reply.message, reply.finish_reason
    )
    await service.recorder.record(plan, conversation, [sampled])


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, ordered[int(len(ordered) * 0.95)] * 1000


async def _measure(
    service: TurnService, model: ChatModel, session_id: str, target: int, new_tokens: int
) -> dict[str, Any]:
    # Grown one tool result past the target, whose last result is then swapped for one of
    # the measured size: the history before it stays about `target` tokens.
    messages = await _grow(service, model, session_id, target + 1000)
    messages[-1] = Message(
        "tool", _tool_output(model, 10_000, new_tokens), tool_call_id=messages[-1].tool_call_id
    )
    engine = EngineClient(["http://127.0.0.1:9"], model="bench")
    replica = engine.replicas[0]
    completion = [*model.encode("Done."), model.stop_token_ids[0]]
    overhead: list[float] = []
    history_tokens = 0
    for i in range(SAMPLES):
        # A different last tool output each time: every sample is a real splice (a fork of
        # the same parent), not a retry of an identical input.
        last = messages[-1]
        varied = Message(last.role, f"{last.content} #{i}", tool_call_id=last.tool_call_id)
        conversation = Conversation(messages=[*messages[:-1], varied], tools=TOOLS)
        started = time.perf_counter()
        plan = await service.planner.plan(session_id, conversation)
        _, body = engine.wire.request(
            replica, Call(session_id, plan.prompt_ids, plan.sampling, None, False), session_id
        )
        encode_body(body)
        await _store_turn(service, model, plan, conversation, completion)
        overhead.append(time.perf_counter() - started)
        assert plan.kind in ("extend", "fork"), plan.kind
        history_tokens = len(plan.prompt_ids)
    await engine.close()
    rerender: list[float] = []
    template_messages = [
        {
            "role": m.role,
            "content": m.content,
            **(
                {
                    "tool_calls": [
                        {
                            "type": "function",
                            "id": c.id,
                            "function": {"name": c.name, "arguments": {"path": "x"}},
                        }
                        for c in m.tool_calls
                    ]
                }
                if m.tool_calls
                else {}
            ),
            **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
        }
        for m in messages
    ]
    tools = [t.as_openai() for t in TOOLS]
    for _ in range(max(20, SAMPLES // 10) if new_tokens == NEW_MESSAGE_TOKENS[0] else 0):
        started = time.perf_counter()
        model.tokenizer.apply_chat_template(
            template_messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        rerender.append(time.perf_counter() - started)
    return {
        "history": history_tokens,
        "overhead": _percentiles(overhead),
        "rerender": _percentiles(rerender) if rerender else None,
    }


async def main(out: Path) -> None:
    model = ChatModel(load_tokenizer(str(qwen3_dir())))
    proc, url = start_redis_server(Path("/tmp"))
    rows = []
    try:
        for store_name, make_store in (("memory", MemoryStore), ("redis", lambda: RedisStore(url))):
            for size in SIZES:
                result: dict[str, Any] = {}
                for new_tokens in NEW_MESSAGE_TOKENS:
                    store = make_store()
                    service = TurnService(
                        store,
                        EngineClient(["http://127.0.0.1:9"], model="bench"),
                        model,
                        ServiceConfig(model_name="bench", context_length=131072),
                        Metrics(),
                    )
                    print(f"{store_name} {size} (+{new_tokens})...", flush=True)
                    measured = await _measure(
                        service, model, f"bench-{size}-{new_tokens}", size, new_tokens
                    )
                    await store.close()
                    result[new_tokens] = measured
                rows.append((store_name, size, result))
    finally:
        stop_redis_server(proc)
    lines = [
        "# Per-turn overhead: tokenkeep vs full re-render",
        "",
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        "2 cores shared with other work. `bench/bench_turn_overhead.py`.",
        "",
        "tokenkeep = lookup + classify + splice/proof + sampling + engine request encoding + "
        "store append (p50/p95 over "
        f"{SAMPLES} turns). Re-render = Qwen3 chat template + tokenize of the same history.",
        "",
        f"| store | history tokens | tokenkeep p50 / p95 ms (+{NEW_MESSAGE_TOKENS[0]}-token "
        f"tool result) | tokenkeep p50 / p95 ms (+{NEW_MESSAGE_TOKENS[1]}-token tool result) "
        "| re-render p50 / p95 ms | re-render / tokenkeep (p50, small result) |",
        "|---|---|---|---|---|---|",
    ]
    for store_name, _size, r in rows:
        small, large = r[NEW_MESSAGE_TOKENS[0]], r[NEW_MESSAGE_TOKENS[1]]
        (sp50, sp95), (lp50, lp95) = small["overhead"], large["overhead"]
        rp50, rp95 = small["rerender"]
        lines.append(
            f"| {store_name} | {small['history']} | {sp50:.2f} / {sp95:.2f} | "
            f"{lp50:.2f} / {lp95:.2f} | {rp50:.1f} / {rp95:.1f} | {rp50 / sp50:.0f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/turn_overhead.md"))
    asyncio.run(main(parser.parse_args().out))
