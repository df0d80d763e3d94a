"""EngineClient against vLLM serving a real model (Gemma 3 270M base): real language out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tokenizers import Tokenizer

from session_server.engines import EngineClient, GenerationDelta
from tests.vllm_fixture import RunningEngine, gemma_engine

pytestmark = pytest.mark.vllm
__all__ = ["gemma_engine"]

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def tokenizer(gemma_engine: RunningEngine) -> Tokenizer:
    return Tokenizer.from_file(str(gemma_engine.model_dir / "tokenizer.json"))


@pytest.fixture
async def client(gemma_engine: RunningEngine) -> AsyncIterator[EngineClient]:
    async with EngineClient([gemma_engine.url], model=gemma_engine.served_model_name) as c:
        yield c


async def test_greedy_completion_is_real_language(
    client: EngineClient, tokenizer: Tokenizer
) -> None:
    prompt = tokenizer.encode("1, 2, 3, 4, 5,").ids
    assert prompt[0] == tokenizer.token_to_id("<bos>")

    generation = await client.generate("gemma", prompt, GREEDY)
    [choice] = generation.choices
    assert tokenizer.decode(choice.token_ids).startswith(" 6, 7, 8, 9,")
    assert generation.prompt_ids == prompt

    streamed: list[int] = []
    async for event in client.stream("gemma", prompt, GREEDY):
        if isinstance(event, GenerationDelta):
            streamed += event.token_ids
    assert streamed == choice.token_ids


async def test_stop_string_is_named_in_stop_reason(
    client: EngineClient, tokenizer: Tokenizer
) -> None:
    prompt = tokenizer.encode("The Eiffel Tower is located in the city of").ids
    generation = await client.generate("gemma", prompt, {**GREEDY, "max_tokens": 40, "stop": ["."]})
    [choice] = generation.choices
    assert (choice.finish_reason, choice.stop_reason) == ("stop", ".")
    # token_ids keep every sampled token, the one carrying the stop string included.
    assert tokenizer.decode(choice.token_ids) == " Paris, France."
