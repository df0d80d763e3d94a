"""Streamed = non-streamed, as a property over the whole reply corpus.

For every family (Qwen3, Llama 3.2, both through their renderer and through the generic
splice), every scripted completion of the corpus and every way of cutting the sampled tokens
into engine chunks (one token per chunk, all at once, and two chunks split at each token),
the text a client assembles from the stream is the non-streamed message. Then the same through
the real server and each API's official SDK (the engine double streams one token per chunk):
the message the SDK client assembles equals the non-streamed one field by field.

The other families (gpt-oss, Qwen 3.5, GLM, DeepSeek, MiniMax) are checked streamed against
non-streamed on the check corpus in `test_family_paths.py`, and all 61 templates in the
bench matrix (`bench/support_matrix.py`)."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from session_server.app import build_service, create_app
from session_server.conversation import Message, Tool
from session_server.reply_split import ReplyStreamer
from session_server.settings import Settings
from session_server.splice import GENERIC, ChatModel
from session_server.tokenizer import load_tokenizer
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import llama32_dir, qwen3_dir
from tests.session.adversarial import TOOLS
from tests.session.reply_corpus import CORPUS, Reply

FAMILIES = {
    "qwen3": (qwen3_dir, "auto"),
    "qwen3-generic": (qwen3_dir, GENERIC),
    "llama3.2": (llama32_dir, "auto"),
    "llama3.2-generic": (llama32_dir, GENERIC),
}
CHAT_TOOLS = [Tool(t["function"]["name"], t["function"]["description"],
                   t["function"]["parameters"]) for t in TOOLS]  # fmt: skip


@functools.cache
def family(name: str) -> ChatModel:
    directory, renderer = FAMILIES[name]
    return ChatModel(load_tokenizer(str(directory())), renderer)


def chunkings(ids: list[int]) -> list[list[list[int]]]:
    """One token per chunk, everything in one chunk, and two chunks cut at every token."""
    cuts = [[ids[:k], ids[k:]] for k in range(1, len(ids))]
    return [[[t] for t in ids], [ids], *cuts]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_streamed_text_adds_up_to_the_parsed_reply(name: str) -> None:
    model = family(name)
    prompt = model.render_prompt([Message(role="user", content="Weather in Paris?")], CHAT_TOOLS)
    for reply in CORPUS:
        ids = reply.completion(model)
        parsed = model.parse(ids, reply.finish_reason, prompt, CHAT_TOOLS).message
        for chunks in chunkings(ids):
            streamer = ReplyStreamer(model, prompt)
            content = reasoning = ""
            content_started = False
            for chunk in chunks:
                delta = streamer.feed(chunk)
                assert not (delta.reasoning and content_started), (reply.name, "order")
                content += delta.content
                reasoning += delta.reasoning
                content_started = content_started or bool(content)
            tail = streamer.finish(parsed)
            assert not (tail.reasoning and content_started), (reply.name, "order")
            assert (content + tail.content, reasoning + tail.reasoning) == (
                parsed.content,
                parsed.reasoning or "",
            ), (reply.name, [len(c) for c in chunks])


# --- through the server and the official SDKs ----------------------------------------------

BASE = "http://tokenkeep.test"
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
QUESTION = "Weather in Paris?"


@pytest.fixture(scope="module")
def double() -> AsyncIterator[EngineDouble]:
    engine = EngineDouble().start()
    yield engine
    engine.stop()


@asynccontextmanager
async def serving(model: ChatModel, double: EngineDouble) -> AsyncIterator[httpx2.AsyncClient]:
    config = Settings(
        engine_urls=[double.url], model=double.model, tokenizer=str(model.tokenizer.name_or_path)
    )
    service = build_service(config, model=model)
    await service.engine.start()  # the ASGI transport runs no lifespan
    try:
        yield httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(config, service)))
    finally:
        await service.engine.close()


def _calls(pairs: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    """Tool calls by position: name and parsed arguments (ids are fresh per request)."""
    return [(name, json.loads(arguments) if arguments else None) for name, arguments in pairs]


async def chat(http: httpx2.AsyncClient, sid: str, stream: bool) -> dict[str, Any]:
    client = openai.AsyncOpenAI(
        api_key="x", base_url=f"{BASE}/sessions/{sid}/v1", http_client=http, max_retries=0
    )
    request: dict[str, Any] = {
        "model": "m", "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS
    }  # fmt: skip
    if not stream:
        completion = await client.chat.completions.create(**request)
        message = completion.choices[0].message
        calls = message.tool_calls or []
        return {
            "content": message.content or "",
            "reasoning": (message.model_extra or {}).get("reasoning_content") or "",
            "calls": _calls([(c.function.name, c.function.arguments) for c in calls]),
            "ids": all(c.id for c in calls),
            "finish": completion.choices[0].finish_reason,
        }
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    finish = None
    async for chunk in await client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.id:
                    ids[call.index] = call.id
                if call.function and call.function.name:
                    entry[0] += call.function.name
                if call.function and call.function.arguments:
                    entry[1] += call.function.arguments
            finish = choice.finish_reason or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": _calls([(n, a) for _, (n, a) in sorted(calls.items())]),
        "ids": all(ids.get(i) for i in calls),
        "finish": finish,
    }


async def responses(http: httpx2.AsyncClient, sid: str, stream: bool) -> dict[str, Any]:
    client = openai.AsyncOpenAI(
        api_key="x", base_url=f"{BASE}/sessions/{sid}/v1", http_client=http, max_retries=0
    )
    request = {"model": "m", "input": QUESTION, "tools": RESPONSES_TOOLS}
    if not stream:
        response = await client.responses.create(**request)
        return {
            "items": [_item(i.model_dump()) for i in response.output],
            "status": response.status,
        }
    items: dict[int, dict[str, Any]] = {}
    status = None
    async for event in await client.responses.create(**request, stream=True):
        if event.type == "response.output_item.added":
            items[event.output_index] = _item(event.item.model_dump(), streamed=True)
        elif event.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[event.output_index]["text"] += event.delta
        elif event.type == "response.function_call_arguments.delta":
            items[event.output_index]["arguments"] += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            status = event.response.status
    return {"items": [items[i] for i in sorted(items)], "status": status}


def _item(item: dict[str, Any], *, streamed: bool = False) -> dict[str, Any]:
    if item["type"] == "function_call":
        return {"type": "function_call", "name": item["name"],
                "arguments": "" if streamed else item["arguments"]}  # fmt: skip
    text = "" if streamed else "".join(part["text"] for part in item.get("content") or [])
    return {"type": item["type"], "text": text}


async def messages(http: httpx2.AsyncClient, sid: str, stream: bool) -> dict[str, Any]:
    client = anthropic.AsyncAnthropic(
        api_key="x", base_url=f"{BASE}/sessions/{sid}", http_client=http, max_retries=0
    )
    request = {
        "model": "m", "max_tokens": 512, "tools": ANTHROPIC_TOOLS,
        "messages": [{"role": "user", "content": QUESTION}],
    }  # fmt: skip
    if stream:
        async with client.messages.stream(**request) as events:
            message = await events.get_final_message()
    else:
        message = await client.messages.create(**request)
    blocks = []
    for block in message.content:
        if block.type == "text":
            blocks.append(("text", block.text))
        elif block.type == "thinking":
            blocks.append(("thinking", block.thinking))
        elif block.type == "tool_use":
            blocks.append(("tool_use", block.name, block.input, bool(block.id)))
    return {"blocks": blocks, "stop": message.stop_reason}


APIS = {"chat": chat, "responses": responses, "messages": messages}


@pytest.mark.parametrize("name", list(FAMILIES))
async def test_every_api_streams_the_non_streamed_message(name: str, double: EngineDouble) -> None:
    model = family(name)
    async with serving(model, double) as http:
        for reply in CORPUS:
            completion = ScriptedCompletion(reply.completion(model), reply.finish_reason)
            for api, ask in APIS.items():
                answers = []
                for stream in (False, True):
                    double.script(completion)
                    answers.append(await ask(http, f"{api}-{uuid.uuid4().hex[:8]}", stream))
                assert answers[0] == answers[1], (name, reply.name, api)


TOOL_REPLY = {"qwen3": "tool_json_compact", "qwen3-generic": "tool_json_compact",
              "llama3.2": "llama_tool_call", "llama3.2-generic": "llama_tool_call"}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("name", list(FAMILIES))
async def test_tool_loop_stays_one_segment(name: str, stream: bool, double: EngineDouble) -> None:
    """The harness sends back what it assembled (streamed or not) and a tool result: the next
    turn extends the stored tokens (a tool call leaked as content would start a new segment)."""
    model = family(name)
    by_name = {r.name: r for r in CORPUS}
    sid = f"loop-{uuid.uuid4().hex[:8]}"
    history: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    async with serving(model, double) as http:
        kinds = []
        for reply in (by_name[TOOL_REPLY[name]], by_name["bpe_split"]):
            double.script(ScriptedCompletion(reply.completion(model), reply.finish_reason))
            answer = await chat_turn(http, sid, history, stream)
            kinds.append(answer.pop("kind"))
            history.append(answer)
            for call in answer.get("tool_calls") or []:
                history.append({"role": "tool", "tool_call_id": call["id"], "content": "18C"})
            if not answer.get("tool_calls"):
                history.append({"role": "user", "content": "And tomorrow?"})
        double.script(ScriptedCompletion(model.encode("Ok") + model.stop_token_ids[:1]))
        kinds.append((await chat_turn(http, sid, history, stream))["kind"])
    assert kinds == ["first", "extend", "extend"]


async def chat_turn(
    http: httpx2.AsyncClient, sid: str, history: list[dict[str, Any]], stream: bool
) -> dict[str, Any]:
    """One turn; the assistant message as an OpenAI-SDK harness assembles and resends it."""
    client = openai.AsyncOpenAI(
        api_key="x", base_url=f"{BASE}/sessions/{sid}/v1", http_client=http, max_retries=0
    )
    request = {"model": "m", "messages": history, "tools": TOOLS}
    if not stream:
        completion = await client.chat.completions.create(**request)
        message = completion.choices[0].message.model_dump(exclude_none=True)
        message.pop("reasoning_content", None)
        message.pop("token_ids", None)
        return {**message, "kind": completion.model_extra["tokenkeep"]["kind"]}
    content, calls, kind = "", {}, None
    async for chunk in await client.chat.completions.create(**request, stream=True):
        kind = (chunk.model_extra or {}).get("tokenkeep", {}).get("kind") or kind
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(
                    call.index,
                    {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": content, "kind": kind}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def test_corpus_names_are_unique() -> None:
    names = [r.name for r in CORPUS]
    assert len(names) == len(set(names))
    assert isinstance(CORPUS[0], Reply)
