"""`tokenkeep demo`: the whole local stack in one command, and a tool-using session through it.

It sets up (once; cached) and starts a real vLLM on this machine's CPU serving a tiny
random-weights model with the real Qwen3 tokenizer and chat template, starts the session
server in front of it (embedded store, or Redis with `--redis-url`), then plays a harness with
the official OpenAI SDK at a session URL: tool calls, tool results, answers. It prints what
was kept (turns, tokens, segments, breaks), writes the trajectory a trainer would read, and
says how to point another harness at a session.

A random-weights model never calls a tool by itself, so each request carries a vLLM
structured-output grammar that makes the engine sample a reasoning block and a hermes
`<tool_call>` (the special tokens by ID, so they are the model's own single tokens). The
text inside is still random sub-word soup: exactly what re-rendering a history breaks on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from session_server.devtools import localengine, train
from session_server.devtools.stack import local_server, progress
from session_server.devtools.weather import weather, weather_tools

CITIES = ("Paris", "Tokyo", "Lima")
TOOLS = weather_tools(CITIES)
# The harness's plan: (a new user message, the city the model is made to ask about, or None
# for a plain answer).
SCRIPT: tuple[tuple[str | None, str | None], ...] = (
    (None, "Paris"),
    (None, "Tokyo"),
    (None, None),
    ("And in Lima?", "Lima"),
    (None, None),
)
WORDS = r"/[a-z]{2,9}( [a-z]{2,9}){1,5}/"


def _token(vocab: dict[str, int], name: str) -> str:
    return f"<[{vocab[name]}]>"


def reasoning_then(vocab: dict[str, int], rest: str) -> str:
    """A llguidance Lark grammar: `<think>` words `</think>`, then `rest` (Lark)."""
    think, end_think = _token(vocab, "<think>"), _token(vocab, "</think>")
    return f'start: {think} "\\n" {WORDS} "\\n" {end_think} "\\n\\n" {rest}\n'


def tool_call_grammar(vocab: dict[str, int], name: str, arguments: dict[str, Sequence[str]]) -> str:
    """Reasoning, then one hermes tool call of `name`, each argument one of the given strings.
    The JSON is written the way Qwen3's template writes it (`", "` and `": "`)."""
    fields = ' ", " '.join(
        f'"\\"{key}\\": \\"" ({" | ".join(json.dumps(v) for v in values)}) "\\""'
        for key, values in arguments.items()
    )
    call = f'"\\n{{\\"name\\": \\"{name}\\", \\"arguments\\": {{" {fields} "}}}}\\n"'
    rest = f"{_token(vocab, '<tool_call>')} {call} {_token(vocab, '</tool_call>')}"
    return reasoning_then(vocab, rest)


def answer_grammar(vocab: dict[str, int]) -> str:
    """Reasoning, then a few words of answer."""
    return reasoning_then(vocab, WORDS)


def drive(base_url: str, model_dir: Path, *, seed: int | None = None) -> dict[str, Any]:
    """Play a tool-using harness against a new session; returns the session's summary."""
    import httpx
    import openai
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab()
    http = httpx.Client(base_url=base_url, timeout=120)
    sampling = {"seed": seed} if seed is not None else {}
    session = http.post("/sessions", json={"sampling": sampling}).json()
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in Paris and in Tokyo?"},
    ]
    tool_calls = 0
    for step, (user, city) in enumerate(SCRIPT):
        if user:
            messages.append({"role": "user", "content": user})
        grammar = (
            tool_call_grammar(vocab, "get_weather", {"city": [city]})
            if city
            else answer_grammar(vocab)
        )
        reply = client.chat.completions.create(
            model=session["id"],
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=128,
            extra_body={"structured_outputs": {"grammar": grammar}, "reasoning_ended": True},
        )
        message = reply.choices[0].message
        info = (reply.model_extra or {}).get("tokenkeep", {})
        sent: dict[str, Any] = {"role": "assistant", "content": message.content}
        reasoning = (message.model_extra or {}).get("reasoning_content")
        if reasoning:
            sent["reasoning_content"] = reasoning
        shown = ""
        if message.tool_calls:
            sent["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            shown = ", ".join(
                f"{c.function.name}({c.function.arguments})" for c in message.tool_calls
            )
        else:
            shown = repr((message.content or "")[:60])
        completion = reply.usage.completion_tokens if reply.usage else 0
        print(
            f"  turn {step + 1}: {info.get('kind', '?'):7} prompt {reply.usage.prompt_tokens:4d}"
            f" + sampled {completion:3d} tokens -> {shown}"
            if reply.usage
            else f"  turn {step + 1}: {shown}",
            flush=True,
        )
        messages.append(sent)
        for call in message.tool_calls or ():
            tool_calls += 1
            city = json.loads(call.function.arguments).get("city", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(city)})
    summary = http.get(f"/sessions/{session['id']}").json()
    summary["tool_calls"] = tool_calls
    summary["viewer_url"] = f"{base_url}/ui/sessions/{session['id']}"
    summary["trajectory_jsonl"] = http.get(
        f"/sessions/{session['id']}/trajectory", params={"format": "jsonl"}
    ).text
    return summary


CLICK_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "click",
        "description": "Click at a point of the screen.",
        "parameters": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 639},
                "y": {"type": "integer", "minimum": 0, "maximum": 399},
            },
            "required": ["x", "y"],
        },
    },
}


def screenshot(step: int) -> str:
    """A 640x400 'desktop' with a window whose place depends on the step, as a data: URL."""
    import base64
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (640, 400), (40, 60, 90))
    draw = ImageDraw.Draw(image)
    left, top = 60 + 90 * step, 50 + 40 * step
    draw.rectangle((left, top, left + 260, top + 170), fill=(230, 230, 230), outline=(0, 0, 0))
    draw.rectangle((left + 180, top + 130, left + 250, top + 160), fill=(70, 130, 220))
    draw.text((left + 12, top + 12), f"Settings - step {step + 1}", fill=(0, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def drive_vision(base_url: str, *, seed: int | None = None, steps: int = 3) -> dict[str, Any]:
    """A computer-use harness: screenshot -> click -> the tool result carries the next
    screenshot -> ... -> a short answer. Returns the session's summary."""
    import httpx
    import openai

    http = httpx.Client(base_url=base_url, timeout=300)
    session = http.post("/sessions", json={"sampling": {"seed": seed} if seed is not None else {}})
    session_body = session.json()
    client = openai.OpenAI(
        base_url=session_body["openai_base_url"], api_key=session_body["api_key"]
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You operate a desktop by clicking."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Press the blue OK button."},
                {"type": "image_url", "image_url": {"url": screenshot(0)}},
            ],
        },
    ]
    tool_calls = 0
    for step in range(steps):
        last = step == steps - 1
        reply = client.chat.completions.create(
            model=session_body["id"],
            messages=messages,  # type: ignore[arg-type]
            tools=[CLICK_TOOL],  # type: ignore[list-item]
            # Random weights call no tool by themselves: a named tool_choice makes the engine
            # sample a real <tool_call> (structured output from the first token).
            **(
                {} if last else {"tool_choice": {"type": "function", "function": {"name": "click"}}}
            ),
            max_tokens=12 if last else 64,
            extra_body={"reasoning_ended": True},
        )
        message = reply.choices[0].message
        info = (reply.model_extra or {}).get("tokenkeep", {})
        sent: dict[str, Any] = {"role": "assistant", "content": message.content}
        calls = message.tool_calls or []
        # Random weights fill the call with whatever whitespace the grammar allows: shown and
        # reported back compactly.
        points = [
            json.dumps(json.loads(c.function.arguments), separators=(",", ":")) for c in calls
        ]
        shown = (
            ", ".join(f"click({point})" for point in points)
            if calls
            else repr((message.content or "")[:60])
        )
        if calls:
            sent["tool_calls"] = [c.model_dump() for c in calls]
        usage = reply.usage
        print(
            f"  turn {step + 1}: {info.get('kind', '?'):7} prompt "
            f"{usage.prompt_tokens if usage else 0:4d} + sampled "
            f"{usage.completion_tokens if usage else 0:3d} tokens -> {shown}",
            flush=True,
        )
        messages.append(sent)
        for call, point in zip(calls, points, strict=True):
            tool_calls += 1
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": [
                        {"type": "text", "text": f"clicked {point}"},
                        {"type": "image_url", "image_url": {"url": screenshot(step + 1)}},
                    ],
                }
            )
    summary = http.get(f"/sessions/{session_body['id']}").json()
    trajectory = http.get(f"/sessions/{session_body['id']}/trajectory").json()
    summary["tool_calls"] = tool_calls
    summary["images"] = sum(
        len(turn.get("images", []))
        for branch in trajectory["branches"]
        for segment in branch["segments"]
        for turn in segment["turns"]
    )
    summary["viewer_url"] = f"{base_url}/ui/sessions/{session_body['id']}"
    summary["trajectory_jsonl"] = http.get(
        f"/sessions/{session_body['id']}/trajectory", params={"format": "jsonl"}
    ).text
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenkeep demo",
        description="Start vLLM (CPU) + the session server locally and run a tool-using session.",
    )
    parser.add_argument("--redis-url", help="keep sessions in this Redis (default: embedded)")
    parser.add_argument("--port", type=int, default=0, help="session server port (default: any)")
    parser.add_argument(
        "--trajectory",
        type=Path,
        default=Path("tokenkeep-demo-trajectory.jsonl"),
        help="where to write the session's trajectory (JSON lines, one per branch)",
    )
    parser.add_argument("--seed", type=int, help="sampling seed (default: random)")
    parser.add_argument(
        "--vision",
        action="store_true",
        help="a screenshot tool loop on the tiny Qwen3-VL (images in user and tool messages)",
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the stack up afterwards for your own harness (Ctrl-C stops it)",
    )
    train.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.train:
        return train.main(args)
    started = time.monotonic()
    progress("[demo] setting up the engine (first run: a few minutes; cached afterwards)")
    try:
        model = localengine.VISION_MODEL_NAME if args.vision else localengine.TINY_MODEL_NAME
        engine = localengine.start(model, progress=progress)
    except localengine.LocalEngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    try:
        with local_server(
            engine.url, engine.served_model_name, engine.model_dir, args.redis_url, args.port
        ) as url:
            store = args.redis_url or "embedded store"
            print(f"\nsession server {url} ({store}) -> vLLM {engine.url}", flush=True)
            if args.vision:
                summary = drive_vision(url, seed=args.seed)
            else:
                summary = drive(url, engine.model_dir, seed=args.seed)
            args.trajectory.write_text(summary.pop("trajectory_jsonl"))
            ok = _report(summary, args.trajectory, time.monotonic() - started, model)
            if args.keep_running:
                print("\nthe stack is up; Ctrl-C stops it", flush=True)
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
    finally:
        engine.stop()
    return 0 if ok else 1


def _report(summary: dict[str, Any], trajectory: Path, seconds: float, name: str) -> bool:
    breaks = sum(summary["breaks"].values())
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary["turns_by_kind"].items())
    model = localengine.served_name(name)
    images = f", {summary['images']} images" if "images" in summary else ""
    lines = [
        "",
        f"session      {summary['openai_base_url']}",
        f"turns        {summary['turns']} ({kinds}), {summary['tool_calls']} tool calls{images}",
        f"tokens       {summary['tokens']} ({summary['sampled_tokens']} sampled by the engine)",
        f"segments     {summary['segments']}",
        f"breaks       {breaks}" + (f" {json.dumps(summary['breaks'])}" if breaks else ""),
        f"trajectory   {trajectory.resolve()}",
        f"viewer       {summary['viewer_url']}",
        f"took         {seconds:.0f}s",
        "",
        "Point your own harness at a session (one base URL per conversation):",
        f"  tokenkeep engine start --model {name} &   # vLLM on the CPU at http://127.0.0.1:8000",
        f"  tokenkeep serve --port 8080 --engine-url http://127.0.0.1:8000 --model {model} \\",
        f"      --tokenizer {localengine.model_dir(name)}",
        "  curl -s -X POST localhost:8080/sessions   # -> openai_base_url, api_key",
        '  OpenAI(base_url="<openai_base_url>", api_key="<api_key>")',
        "or run `tokenkeep demo --keep-running` and use the session URL above.",
    ]
    print("\n".join(lines), flush=True)
    return breaks == 0 and summary["segments"] == 1 and summary["tool_calls"] > 0
