"""EngineClient against the real vLLM CPU engine (tiny random-weights Qwen3, real tokenizer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from tokenizers import Tokenizer

from session_server.engines import (
    EngineClient,
    EngineError,
    GenerationDelta,
    Protocol,
    StreamStart,
)
from tests.vllm_fixture import RunningEngine

pytestmark = pytest.mark.vllm

IM_END, END_OF_TEXT, HELLO = 151645, 151643, 9707
# Every parameter explicit: /generate applies none of generation_config.json.
SAMPLING: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.0,
    "seed": 1234,
    "max_tokens": 6,
}


@pytest.fixture(scope="module")
def tokenizer(vllm_engine: RunningEngine) -> Tokenizer:
    return Tokenizer.from_file(str(vllm_engine.model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[0] == 151644 and IM_END in ids  # the special tokens are single ids
    return ids


@pytest.fixture
async def client(vllm_engine: RunningEngine) -> AsyncIterator[EngineClient]:
    async with EngineClient([vllm_engine.url], model=vllm_engine.served_model_name) as c:
        yield c


async def collect_stream(
    client: EngineClient, prompt_ids: list[int], sampling: dict[str, Any]
) -> tuple[StreamStart, dict[int, GenerationDelta]]:
    start: StreamStart | None = None
    merged: dict[int, GenerationDelta] = {}
    async for event in client.stream("real-session", prompt_ids, sampling):
        if isinstance(event, StreamStart):
            assert start is None
            start = event
            continue
        assert len(event.token_ids) == len(event.logprobs)
        if event.cached_tokens is not None and not event.token_ids:
            # the usage chunk (include_usage) follows the finishing one: no tokens, only
            # the prompt's cached-token count
            assert 0 <= event.cached_tokens <= len(prompt_ids)
            continue
        total = merged.setdefault(event.index, GenerationDelta(event.index, [], [], None, None))
        assert total.finish_reason is None, "tokens after the finishing chunk"
        total.token_ids += event.token_ids
        total.logprobs += event.logprobs
        total.finish_reason, total.stop_reason = event.finish_reason, event.stop_reason
    assert start is not None
    return start, merged


async def test_generate_and_stream_agree_token_for_token(
    vllm_engine: RunningEngine, client: EngineClient, prompt_ids: list[int]
) -> None:
    assert await client.ready()
    generation = await client.generate("real-session", prompt_ids, SAMPLING)
    assert generation.prompt_ids == prompt_ids
    assert generation.engine_url == vllm_engine.url
    [choice] = generation.choices
    assert len(choice.token_ids) == len(choice.logprobs) == 6
    assert choice.finish_reason == "length"
    assert all(-30 < lp <= 0 for lp in choice.logprobs)

    start, merged = await collect_stream(client, prompt_ids, SAMPLING)
    assert start.prompt_ids == prompt_ids
    assert merged[0].token_ids == choice.token_ids
    assert merged[0].logprobs == pytest.approx(choice.logprobs, abs=1e-4)
    assert merged[0].finish_reason == "length"


async def test_n_choices(client: EngineClient, prompt_ids: list[int]) -> None:
    sampling = {**SAMPLING, "n": 3, "max_tokens": 4}
    generation = await client.generate("real-session", prompt_ids, sampling)
    assert [c.index for c in generation.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == len(c.logprobs) == 4 for c in generation.choices)

    _, merged = await collect_stream(client, prompt_ids, sampling)
    assert sorted(merged) == [0, 1, 2]
    assert all(len(d.token_ids) == 4 and d.finish_reason == "length" for d in merged.values())


async def test_end_of_turn_token_ends_the_turn(client: EngineClient, prompt_ids: list[int]) -> None:
    # The tokenizer's EOS (<|im_end|>) stops with stop_reason None and is kept in token_ids.
    sampling = {**SAMPLING, "max_tokens": 200, "allowed_token_ids": [HELLO, IM_END]}
    generation = await client.generate("real-session", prompt_ids, sampling)
    [choice] = generation.choices
    assert choice.token_ids[-1] == IM_END and set(choice.token_ids[:-1]) <= {HELLO}
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)

    # <|endoftext|> is a stop token from generation_config.json: vLLM names it.
    sampling = {**SAMPLING, "max_tokens": 200, "allowed_token_ids": [HELLO, END_OF_TEXT]}
    _, merged = await collect_stream(client, prompt_ids, sampling)
    assert merged[0].token_ids[-1] == END_OF_TEXT
    assert (merged[0].finish_reason, merged[0].stop_reason) == ("stop", END_OF_TEXT)


async def test_structured_output_applies_with_reasoning_ended(
    client: EngineClient, prompt_ids: list[int], tokenizer: Tokenizer
) -> None:
    sampling = {**SAMPLING, "max_tokens": 20, "structured_outputs": {"regex": "(ab){3}"}}
    generation = await client.generate("real-session", prompt_ids, sampling, reasoning_ended=True)
    [choice] = generation.choices
    assert choice.finish_reason == "stop"
    # The grammar's text, then an end token (the grammar allows only those once complete).
    assert tokenizer.decode(choice.token_ids[:-1]) == "ababab"
    assert choice.token_ids[-1] in (IM_END, END_OF_TEXT)


async def test_engine_rejections_are_client_errors(
    vllm_engine: RunningEngine, client: EngineClient, prompt_ids: list[int]
) -> None:
    with pytest.raises(EngineError) as raised:
        await client.generate("real-session", [*prompt_ids, 151936], SAMPLING)
    assert raised.value.status == 400
    assert raised.value.message == "Token id 151936 is out of vocabulary"

    too_long = [HELLO] * (vllm_engine.max_model_len + 1)
    with pytest.raises(EngineError) as raised:
        await client.generate("real-session", too_long, SAMPLING)
    assert raised.value.status == 400
    with pytest.raises(EngineError) as raised:
        async for _ in client.stream("real-session", too_long, SAMPLING):
            pass
    assert raised.value.status == 400
    assert "maximum model length" in raised.value.message

    with pytest.raises(EngineError) as raised:
        await client.generate("real-session", prompt_ids, {**SAMPLING, "temperature": -1})
    assert (raised.value.status, raised.value.param) == (400, "temperature")


async def test_completions_fallback_samples_the_same_tokens(
    client: EngineClient, prompt_ids: list[int]
) -> None:
    """The fallback path must send the same sampling parameters the token endpoint gets."""
    expected = await client.generate("real-session", prompt_ids, SAMPLING)
    client.replicas[0].protocol = Protocol.COMPLETIONS

    fallback = await client.generate("real-session", prompt_ids, SAMPLING)
    assert fallback.prompt_ids == prompt_ids
    assert fallback.choices[0].token_ids == expected.choices[0].token_ids
    assert fallback.choices[0].logprobs == pytest.approx(expected.choices[0].logprobs, abs=1e-4)

    start, merged = await collect_stream(client, prompt_ids, SAMPLING)
    assert start.prompt_ids == prompt_ids
    assert merged[0].token_ids == expected.choices[0].token_ids
