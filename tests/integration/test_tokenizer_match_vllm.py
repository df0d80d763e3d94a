"""The session server compares its tokenizer with the real vLLM CPU engine's before it sends
a turn there (`session_server/tokenizer_match.py`): a server started with another model's
tokenizer (Llama 3.2's, against the engine's Qwen3) refuses every turn with a clean 503 in the
API's shape and says why on /readyz and /metrics; the server with the engine's own tokenizer
serves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from session_server.app import create_app
from session_server.settings import Settings
from tests.live_server import serving
from tests.real_tokenizers import llama32_dir
from tests.vllm_fixture import RunningEngine

pytestmark = pytest.mark.vllm


@contextmanager
def _server(engine: RunningEngine, redis_url: str, tokenizer: str) -> Iterator[str]:
    settings = Settings(
        engine_urls=[engine.url],
        model=engine.served_model_name,
        tokenizer=tokenizer,
        context_length=engine.max_model_len,
        redis_url=redis_url,
    )
    with serving(create_app(settings)) as url:
        yield url


def _turn(url: str) -> openai.types.chat.ChatCompletion:
    with httpx.Client(base_url=url, timeout=120) as http:
        session = http.post("/sessions", json={"sampling": {"seed": 1}}).json()
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi."}], max_tokens=3
    )


def test_a_server_with_another_models_tokenizer_refuses_turns(
    vllm_engine: RunningEngine, redis_server: str
) -> None:
    with _server(vllm_engine, redis_server, str(llama32_dir())) as url:
        with pytest.raises(openai.APIStatusError) as refused:
            _turn(url)
        assert refused.value.status_code == 503
        error = refused.value.body
        assert isinstance(error, dict) and error["type"] == "TokenizerMismatch"
        assert "tokenizes" in error["message"] and vllm_engine.url in error["message"]

        with httpx.Client(base_url=url, timeout=30) as http:
            ready = http.get("/readyz")
            metrics = http.get("/metrics").text
        # The session API stays up; the replica is named with the reason it gets no turns.
        assert ready.status_code == 200
        [reason] = ready.json()["refused"].values()
        assert reason.startswith("tokenizer mismatch: the engine's tokenizer gives")
        assert f'tokenkeep_engine_tokenizer_mismatch{{replica="{vllm_engine.url}"}} 1.0' in metrics


def test_a_server_with_the_engines_tokenizer_serves(
    vllm_engine: RunningEngine, redis_server: str
) -> None:
    with _server(vllm_engine, redis_server, str(vllm_engine.model_dir)) as url:
        assert _turn(url).choices[0].message is not None
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/readyz").json()["refused"] == {}
            metrics = http.get("/metrics").text
        assert f'tokenkeep_engine_tokenizer_mismatch{{replica="{vllm_engine.url}"}} 0.0' in metrics
