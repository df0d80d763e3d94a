"""Tier 3: the whole stack for real: session server + vLLM CPU + Redis + the OpenAI SDK.

The engine is the session-wide tiny random-weights Qwen3 (`tests/vllm_fixture.py`), reached
through a recording relay (`relay.py`) so each turn's prompt can be checked against the prompt
vLLM itself reports. The naive re-render tally of these conversations is printed at the end
of the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from session_server.app import create_app
from session_server.settings import Settings
from session_server.splice import ChatModel
from session_server.tokenizer import load_tokenizer
from tests.integration.relay import Relay
from tests.live_server import serving
from tests.vllm_fixture import RunningEngine, vllm_engine

__all__ = ["vllm_engine"]


@dataclass
class NaiveTally:
    """Continued turns a full re-render of the harness's messages would have broken."""

    continued: int = 0
    broken: list[str] = field(default_factory=list)


TALLY = NaiveTally()


@dataclass
class RealStack:
    url: str
    relay: Relay
    model: ChatModel
    engine: RunningEngine

    def openai(self, session: dict[str, Any]) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)


@pytest.fixture(scope="module")
def real_stack(vllm_engine: RunningEngine, redis_server: str) -> Iterator[RealStack]:
    relay = Relay(vllm_engine.url)
    with serving(relay.app()) as relay_url:
        settings = Settings(
            engine_urls=[relay_url],
            model=vllm_engine.served_model_name,
            tokenizer=str(vllm_engine.model_dir),
            context_length=vllm_engine.max_model_len,
            redis_url=redis_server,
        )
        with serving(create_app(settings)) as url:
            model = ChatModel(load_tokenizer(str(vllm_engine.model_dir)))
            yield RealStack(url, relay, model, vllm_engine)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TALLY.continued:
        return
    terminalreporter.write_sep("-", "naive re-render vs tokenkeep against real vLLM")
    terminalreporter.write_line(
        f"naive re-render would have broken {len(TALLY.broken)} of {TALLY.continued} "
        f"continued turns; tokenkeep broke 0"
    )
    for line in TALLY.broken:
        terminalreporter.write_line(f"  {line}")
