"""Running the check: each scenario through each API (streamed and not) of an in-process
app in front of `ScriptedEngine`, comparing what the engine got on each later turn with what
was stored, and what a naive re-rendering server would have sent."""

from __future__ import annotations

import contextlib
import copy
import json
import secrets
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import httpx

from session_server.check.engine import ScriptedEngine
from session_server.check.harnesses import HARNESSES
from session_server.check.report import Report, Row
from session_server.check.scenarios import (
    APIS,
    CHECK_MODEL,
    FIRST_USER,
    FOLLOW_UPS,
    SCENARIOS,
    TOOL_RESULT,
    Completion,
    Scenario,
    Scripter,
    one_line,
)
from session_server.settings import Settings
from session_server.splice import ChatModel


class CheckInputError(Exception):
    """The tokenizer folder cannot be checked (exit 2, one line)."""


def load_model(tokenizer_dir: str, renderer: str = "auto") -> ChatModel:
    """The tokenizer and template as `tokenkeep serve` loads them; CheckInputError if the
    folder cannot serve chat at all."""
    from session_server.tokenizer import load_tokenizer

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise CheckInputError(f"{tokenizer_dir}: not a directory")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckInputError(f"{tokenizer_dir}: no tokenizer here (no tokenizer.json)")
    try:
        tokenizer = load_tokenizer(str(path))
    except Exception as exc:  # whatever transformers raises on a broken folder
        raise CheckInputError(
            f"{tokenizer_dir}: cannot load the tokenizer: {one_line(exc)}"
        ) from exc
    if not tokenizer.chat_template:
        raise CheckInputError(f"{tokenizer_dir}: the tokenizer has no chat template")
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": FIRST_USER}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    except Exception as exc:  # a template's own raise_exception(), or a Jinja error
        raise CheckInputError(f"{tokenizer_dir}: the chat template fails: {one_line(exc)}") from exc
    try:
        return ChatModel(tokenizer, renderer)
    except Exception as exc:
        raise CheckInputError(f"renderer {renderer!r}: {one_line(exc)}") from exc


async def run_check(
    model: ChatModel,
    *,
    name: str = "",
    scenarios: list[Scenario] | None = None,
    apis: Iterable[str] = APIS,
    streams: Iterable[bool] = (False, True),
    progress: Callable[[str], None] | None = None,
) -> Report:
    from session_server.app import build_service, create_app
    from session_server.engines import EngineClient
    from session_server.store.memory import MemoryStore

    report = Report(
        model=name or str(model.tokenizer.name_or_path),
        renderer=model.family,
        path_reason=model.path.reason,
    )
    engine = ScriptedEngine()
    # The in-process app is the check's own: whatever TOKENKEEP_ADMIN_KEY the environment sets
    # (the operator always sets one), it gets a key of its own and every request presents it,
    # so the check goes through the auth layer as a deployed server's clients do.
    admin_key = secrets.token_urlsafe(24)
    settings = Settings(model=CHECK_MODEL, tokenizer="", renderer=model.family, admin_key=admin_key)
    service = build_service(
        settings,
        store=MemoryStore(),
        model=model,
        # ScriptedEngine implements EngineClient's interface, in-process.
        engine=cast(EngineClient, engine),
    )
    app = create_app(settings, service)
    scripter = Scripter(model)
    follow_ups = [(user, scripter.plain(reply)) for user, reply in FOLLOW_UPS]
    planned: list[tuple[Scenario, Completion]] = []
    for scenario in scenarios if scenarios is not None else SCENARIOS:
        completion, why = scripter.completion(scenario)
        if completion is None:
            report.skipped[scenario.name] = why or "not applicable"
        else:
            planned.append((scenario, completion))
    runs = [(s, c, api, stream) for s, c in planned for api in apis for stream in streams]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://check",
        headers={"Authorization": f"Bearer {admin_key}"},
        timeout=60,
    ) as client:
        for done, (scenario, completion, api, stream) in enumerate(runs):
            if progress:
                progress(
                    f"[{done + 1}/{len(runs)}] {scenario.name} {api}{' stream' if stream else ''}"
                )
            engine.reset()
            report.rows.append(
                await _run_one(
                    client, engine, scripter, scenario, completion, follow_ups, api, stream
                )
            )
    _compare_streams(report.rows)
    return report


def _compare_streams(rows: list[Row]) -> None:
    """Marks each streamed run whose first reply differs from the non-streamed run's."""
    plain = {(r.name, r.api): r.first_reply for r in rows if not r.stream}
    for row in rows:
        twin = plain.get((row.name, row.api))
        if not row.stream or twin is None or row.first_reply is None:
            continue
        row.stream_equal = row.first_reply == twin
        if not row.stream_equal:
            row.reason = "; ".join(
                filter(None, [f"streamed {row.first_reply} != non-streamed {twin}", row.reason])
            )


async def _run_one(
    client: httpx.AsyncClient,
    engine: ScriptedEngine,
    scripter: Scripter,
    scenario: Scenario,
    first: Completion,
    follow_ups: list[tuple[str, Completion]],
    api: str,
    stream: bool,
) -> Row:
    model = scripter.model
    session = f"check-{uuid.uuid4().hex[:16]}"
    harness = HARNESSES[api](scenario.tools, scenario.harness_strips)
    harness.add_user(FIRST_USER)
    chat: list[dict[str, Any]] = [{"role": "user", "content": FIRST_USER}]
    completions = [first, *(c for _, c in follow_ups)]
    engine.script(*completions)
    naive_prev: list[int] | None = None
    naive_reason: str | None = None
    failure: str | None = None
    calls_parsed: bool | None = None
    first_reply: dict[str, Any] | None = None
    for turn, completion in enumerate(completions):
        try:
            naive = _naive_prompt(scripter, chat, scenario.tools)
        except Exception as exc:  # the template rejects the history as the harness sent it
            naive_reason = naive_reason or f"turn {turn + 1}: re-rendering fails: {one_line(exc)}"
            naive = []
        if naive_prev is not None and naive_reason is None:
            naive_reason = _first_difference(model, naive_prev, naive, turn)
        response = await client.post(
            f"/sessions/{session}{harness.path}", json=harness.body(stream)
        )
        if response.status_code != 200:
            answer = response.text[:200]
            failure = f"turn {turn + 1}: the {api} API answered {response.status_code}: {answer}"
            break
        try:
            echo = harness.reply(response, stream)
        except (KeyError, ValueError, StopIteration) as exc:
            failure = f"turn {turn + 1}: unreadable {api} reply: {one_line(exc)}"
            break
        chat.append(echo.chat)
        if turn == 0:
            first_reply = _comparable(echo.chat)
            if scenario.reply.get("tool_calls"):
                calls_parsed = _same_calls(echo.chat, scenario.reply)
        naive_prev = naive + completion.token_ids
        if turn + 1 == len(completions):
            break
        user, _ = follow_ups[turn]
        if turn == 0 and scenario.follow_up_is_tool and echo.call_ids:
            harness.add_tool_result(echo.call_ids[0], TOOL_RESULT)
            chat.append({"role": "tool", "tool_call_id": echo.call_ids[0], "content": TOOL_RESULT})
        else:
            harness.add_user(user)
            chat.append({"role": "user", "content": user})
    tokenkeep_reason = failure
    if failure is None:
        for turn in range(1, len(engine.prompts)):
            stored = engine.prompts[turn - 1] + completions[turn - 1].token_ids
            difference = _first_difference(model, stored, engine.prompts[turn], turn)
            if difference is not None:
                breaks = (await client.get(f"/sessions/{session}")).json().get("breaks") or {}
                recorded = ", ".join(sorted(breaks)) or "none"
                tokenkeep_reason = f"new segment (recorded: {recorded}); {difference}"
                break
    reasons = [f"tokenkeep: {tokenkeep_reason}" if tokenkeep_reason else None]
    reasons.append(f"naive: {naive_reason}" if naive_reason else None)
    if calls_parsed is False:
        reasons.insert(0, f"tool call not parsed: the harness got {first_reply}")
    return Row(
        name=scenario.name,
        api=api,
        stream=stream,
        naive_contiguous=naive_reason is None,
        contiguous=tokenkeep_reason is None,
        reason="; ".join(r for r in reasons if r) or None,
        naive_reason=naive_reason,
        tokenkeep_reason=tokenkeep_reason,
        calls_parsed=calls_parsed,
        first_reply=first_reply,
    )


def _comparable(chat: dict[str, Any]) -> dict[str, Any]:
    """A reply as the harness kept it, without the per-request call ids."""
    out = {k: v for k, v in chat.items() if k != "tool_calls"}
    out["calls"] = [
        (c["function"]["name"], _json_or_text(c["function"]["arguments"]))
        for c in chat.get("tool_calls") or []
    ]
    return out


def _same_calls(chat: dict[str, Any], scripted: dict[str, Any]) -> bool:
    """The harness got the scripted calls as calls (names and arguments)."""
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in scripted["tool_calls"]]
    return _comparable(chat)["calls"] == expected


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _naive_prompt(scripter: Scripter, chat: list[dict[str, Any]], tools: bool) -> list[int]:
    """What a server without tokenkeep sends: the template over the whole history as the
    harness sent it (tool-call arguments parsed back into objects, as vLLM's chat endpoint
    does)."""
    messages = copy.deepcopy(chat)
    for m in messages:
        for call in m.get("tool_calls") or []:
            with contextlib.suppress(TypeError, ValueError):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = scripter.render_text(messages, tools, generation_prompt=True)
    return scripter.model.encode(text)


def _first_difference(
    model: ChatModel, stored: list[int], prompt: list[int], turn: int
) -> str | None:
    """None if `prompt` starts with every stored token; else where and how it differs."""
    if prompt[: len(stored)] == stored:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(stored, prompt, strict=False)) if a != b),
        min(len(stored), len(prompt)),
    )
    kept = model.decode(stored[at:])
    got = model.decode(prompt[at:])
    how = "same text, different tokens" if got.startswith(kept) else "text changed"
    return (
        f"turn {turn + 1} differs at token {at} ({how}): "
        f"stored {_excerpt(model.decode(stored[at : at + 6]))} "
        f"vs {_excerpt(model.decode(prompt[at : at + 6]))}"
    )


def _excerpt(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
