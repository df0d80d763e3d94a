"""A real session server (memory store, real Qwen3 tokenizer) in front of the engine double,
driven by the official SDKs over an in-process ASGI transport.

Completions are scripted as Qwen3 token IDs, split into non-canonical pieces where that is
what a model can sample, so every test shows whether the engine saw the sampled tokens again.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import openai
from fastapi import FastAPI

from session_server.app import build_service, create_app
from session_server.conversation import Conversation
from session_server.settings import Settings
from session_server.splice import ChatModel, to_renderer_messages
from session_server.tokenizer import load_tokenizer
from session_server.turns.planning import Plan
from session_server.turns.service import TurnService
from tests.engine_double import EngineDouble, RecordedRequest, ScriptedCompletion
from tests.real_tokenizers import qwen3_dir
from tests.suffix_reference import assert_suffix, assert_suffix_carries
from tests.trajectory_values import assert_trajectory_values

BASE = "http://tokenkeep.test"


@functools.cache
def qwen3() -> ChatModel:
    return ChatModel(load_tokenizer(str(qwen3_dir())))


def pieces(*texts: str) -> list[int]:
    """Token IDs of `texts` encoded one by one: special tokens by name, the rest split the
    way a model may sample it (not the canonical BPE of the whole string)."""
    tokenizer = qwen3().tokenizer
    ids: list[int] = []
    for text in texts:
        special = tokenizer.convert_tokens_to_ids(text)
        if text in tokenizer.get_vocab() and text.startswith("<"):
            ids.append(special)
        else:
            ids.extend(tokenizer.encode(text, add_special_tokens=False))
    return ids


def reply(*texts: str, finish: str = "stop") -> ScriptedCompletion:
    """A completion ending with <|im_end|> (the stop token vLLM reports), unless cut short."""
    ids = pieces(*texts)
    if finish == "length":
        return ScriptedCompletion(ids, finish_reason="length")
    return ScriptedCompletion([*ids, pieces("<|im_end|>")[0]], stop_reason=None)


def tool_call(
    name: str, arguments_json: str, *, think: str | None = None, text: str = ""
) -> ScriptedCompletion:
    """A Qwen3 tool call, its JSON sampled exactly as given (compact, odd key order...)."""
    head = ("<think>", "\n" + think + "\n", "</think>", "\n\n") if think is not None else ()
    body = ('\n{"name": "', name, '", "arguments": ', arguments_json, "}\n")
    return reply(*head, *((text,) if text else ()), "<tool_call>", *body, "</tool_call>")


@dataclass
class Stack:
    app: FastAPI
    service: TurnService
    double: EngineDouble
    sent: list[ScriptedCompletion] = field(default_factory=list)
    planned: list[tuple[Conversation, Plan]] = field(default_factory=list)
    """Every request the core planned, as the front-end translated it."""
    url: str | None = None
    """Set while the app also serves on a real port (for harnesses run as processes)."""

    def script(self, *completions: ScriptedCompletion) -> None:
        self.sent.extend(completions)
        self.double.script(*completions)

    def transport(self) -> httpx2.AsyncBaseTransport:
        return httpx2.ASGITransport(app=self.app)

    def anthropic(self, session_id: str) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            api_key=f"tk-{session_id}",
            base_url=f"{BASE}/sessions/{session_id}",
            max_retries=0,
            http_client=httpx2.AsyncClient(transport=self.transport()),
        )

    def openai(self, session_id: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            api_key=f"tk-{session_id}",
            base_url=f"{BASE}/sessions/{session_id}/v1",
            max_retries=0,
            http_client=httpx2.AsyncClient(transport=self.transport()),
        )

    async def get(self, path: str) -> Any:
        # Over the real port while there is one: the app's store then lives on its loop.
        transport = None if self.url else self.transport()
        async with httpx2.AsyncClient(transport=transport, base_url=self.url or BASE) as http:
            response = await http.get(path)
            response.raise_for_status()
            return response.json()

    async def trajectory(self, session_id: str, *, every_sample: bool = False) -> Any:
        """The session's export, its values checked against what the double sampled
        (`tests/trajectory_values.py`); `every_sample`: the stack served only this session."""
        trajectory = await self.get(f"/sessions/{session_id}/trajectory")
        assert_trajectory_values(trajectory, self.double.samples, every_sample=every_sample)
        return trajectory

    def assert_engine_got(self, *texts: str) -> None:
        """The tokens the last engine request added after the turn before it hold each of
        `texts`, in order. The test reads them off its own wire request: the suffix reference
        (`assert_suffixes`) is given tokenkeep's translation, which cannot catch a front-end
        that loses part of a message."""
        requests = self.engine_requests()
        before, last = requests[-2:]
        stored = before.prompt_ids + self.sent[len(requests) - 2].token_ids
        assert last.prompt_ids[: len(stored)] == stored
        added = qwen3().decode(last.prompt_ids[len(stored) :])
        position = 0
        for text in texts:
            found = added.find(text, position)
            assert found >= 0, f"{text!r} is not in what the engine got: {added!r}"
            position = found + len(text)

    def engine_requests(self) -> list[RecordedRequest]:
        return list(self.double.requests)

    def assert_contiguous(self) -> None:
        """Each engine request starts with the previous one's prompt plus every token the
        double sampled for it, unchanged."""
        requests = self.engine_requests()
        assert len(requests) == len(self.sent), (len(requests), len(self.sent))
        for before, after, sampled in zip(requests, requests[1:], self.sent, strict=False):
            history = before.prompt_ids + sampled.token_ids
            assert after.prompt_ids[: len(history)] == history
        self.assert_suffixes()

    def assert_suffixes(self) -> None:
        """Every continued turn added exactly the chat template's tail for its new messages
        (`tests/suffix_reference.py`); a request that names the turn it continues
        (`previous_response_id`) sends only the new items, so there the added tokens must
        carry each of them and end with the generation prompt."""
        model = qwen3()
        for conversation, plan in self.planned:
            if plan.kind not in ("extend", "fork"):
                continue
            stored = plan.prompt_ids[: len(plan.prompt_ids) - len(plan.prompt_delta)]
            messages = to_renderer_messages(conversation.messages)
            if conversation.previous_response_id:
                assert_suffix_carries(model, plan.prompt_delta, messages)
                continue
            sampled = max(
                (c.token_ids for c in self.sent if stored[-len(c.token_ids) :] == c.token_ids),
                key=len,
                default=None,
            )
            assert sampled is not None, "the stored turn ends with no scripted completion"
            tools = [t.as_openai() for t in conversation.tools] or None
            assert_suffix(model, plan.prompt_ids, stored, sampled, messages, tools)


@asynccontextmanager
async def serving(double: EngineDouble, **settings: Any) -> AsyncIterator[Stack]:
    double.reset()
    config = Settings(
        engine_urls=[double.url], model=double.model, tokenizer=str(qwen3_dir()), **settings
    )
    service = build_service(config, model=qwen3())
    app = create_app(config, service)
    # The ASGI transport runs no lifespan: start and stop the engine client here.
    await service.engine.start()
    stack = Stack(app=app, service=service, double=double)
    plan = service.planner.plan

    async def recording_plan(session_id: str, conversation: Conversation) -> Plan:
        planned = await plan(session_id, conversation)
        stack.planned.append((conversation, planned))
        return planned

    service.planner.plan = recording_plan  # type: ignore[method-assign]
    try:
        yield stack
    finally:
        await service.engine.close()
