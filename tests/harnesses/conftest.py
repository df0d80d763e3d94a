"""Real agent harnesses against a live session server (real port, real tokenizer, memory
store) in front of the engine double, which scripts the tool calls the harness executes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from session_server.app import build_service, create_app
from session_server.settings import Settings
from tests.api.stack import Stack, qwen3
from tests.engine_double import EngineDouble
from tests.harnesses.recording import RequestRecorder
from tests.live_server import serving
from tests.real_tokenizers import qwen3_dir

# Harness prompts are long (Claude Code sends ~12k tokens of system prompt and tools).
CONTEXT = 65536


@pytest.fixture(scope="module")
def double() -> Iterator[EngineDouble]:
    engine = EngineDouble(max_model_len=CONTEXT).start()
    yield engine
    engine.stop()


@contextmanager
def live_stack(double: EngineDouble, records: list[dict[str, Any]]) -> Iterator[Stack]:
    double.reset()
    config = Settings(
        engine_urls=[double.url],
        model=double.model,
        tokenizer=str(qwen3_dir()),
        context_length=CONTEXT,
    )
    service = build_service(config, model=qwen3())
    app = create_app(config, service)
    app.add_middleware(RequestRecorder, records=records)
    with serving(app) as url:
        yield Stack(app=app, service=service, double=double, url=url)
