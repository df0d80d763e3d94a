"""A whole session server (real tokenizer, real store, real HTTP) in front of the engine
double, driven by the official OpenAI SDK."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from session_server.app import build_service, create_app
from session_server.engine_wire import wire_for
from session_server.engines import EngineClient
from session_server.settings import Settings
from session_server.splice import ChatModel
from session_server.store.memory import MemoryStore
from session_server.store.redis import RedisStore
from session_server.tokenizer import load_tokenizer
from session_server.turns.service import TurnService
from tests.engine_double import EngineDouble, _engine_double_pool, engine_double, engine_doubles
from tests.engine_double_sglang import _sglang_double, sglang_double
from tests.live_server import serving
from tests.real_tokenizers import llama32_dir, qwen3_dir

__all__ = [
    "_engine_double_pool",
    "_sglang_double",
    "engine_double",
    "engine_doubles",
    "sglang_double",
]


@pytest.fixture(scope="session")
def qwen3_model() -> ChatModel:
    return ChatModel(load_tokenizer(str(qwen3_dir())))


@pytest.fixture(scope="session")
def llama32_model() -> ChatModel:
    return ChatModel(load_tokenizer(str(llama32_dir())))


@dataclass
class Stack:
    url: str
    double: EngineDouble
    service: TurnService
    model: ChatModel

    def openai(self, session_id: str, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/sessions/{session_id}/v1",
            api_key="unused",
            max_retries=0,
            **kwargs,
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def prompts(self) -> list[list[int]]:
        return [r.prompt_ids for r in self.double.requests]

    def trajectory(self, session_id: str) -> dict[str, Any]:
        with self.http() as client:
            response = client.get(f"/sessions/{session_id}/trajectory")
            response.raise_for_status()
            return response.json()


def make_stack(
    model: ChatModel,
    double: EngineDouble,
    store_kind: str,
    redis_url: str | None,
    **settings: Any,
) -> Iterator[Stack]:
    config = Settings(
        engine_urls=[double.url],
        model=double.model,
        tokenizer=str(model.tokenizer.name_or_path),
        context_length=settings.pop("context_length", double.max_model_len),
        **settings,
    )
    # A key prefix per stack (per test): tests reuse session ids, and the Redis server is
    # shared by the whole run, so without it results would depend on the order.
    store = (
        MemoryStore()
        if store_kind == "memory"
        else RedisStore(redis_url or "", key_prefix=f"t{uuid.uuid4().hex[:12]}")
    )
    service = build_service(
        config,
        store=store,
        model=model,
        engine=EngineClient(
            [double.url], model=double.model, wire=wire_for(config.engine_kind, double.model)
        ),
    )
    with serving(create_app(config, service)) as url:
        yield Stack(url=url, double=double, service=service, model=model)


@pytest.fixture(params=["memory", "redis"])
def stack(
    request: pytest.FixtureRequest,
    qwen3_model: ChatModel,
    engine_double: EngineDouble,
    redis_server: str,
) -> Iterator[Stack]:
    """Qwen3 session server on both stores (the same behaviour is required of each)."""
    yield from make_stack(qwen3_model, engine_double, request.param, redis_server)


@pytest.fixture
def memory_stack(qwen3_model: ChatModel, engine_double: EngineDouble) -> Iterator[Stack]:
    yield from make_stack(qwen3_model, engine_double, "memory", None)


def tokenizer_dir(model: ChatModel) -> Path:
    return Path(model.tokenizer.name_or_path)
