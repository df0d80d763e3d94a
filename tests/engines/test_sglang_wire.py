"""The SGLang wire against the bodies written from SGLang's source (tests/fixtures/sglang/):
what the client sends has exactly their fields, the double answers in exactly their shape,
and the client reads them as it reads vLLM's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.engine_wire import SglangWire
from session_server.engine_wire.base import Call, Replica
from session_server.engines import EngineClient, EngineError
from session_server.store.base import WeightSpan
from tests.engine_double import ScriptedCompletion
from tests.engine_double_sglang import SAMPLING_PARAMS, SglangDouble

FIXTURES = Path(__file__).parent.parent / "fixtures" / "sglang"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 64}


def _fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def _shape(value: Any) -> Any:
    """Field names, nested (lists by their first element)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [_shape(value[0])]
    return None


def test_the_request_has_exactly_sglangs_fields() -> None:
    wire = SglangWire("m")
    call = Call("s", [1, 2, 3], {**SAMPLING, "n": 1, "stop_token_ids": [7]}, None, False)
    path, body = wire.request(Replica("http://e"), call, "s-0123")
    expected = _fixture("request.json")
    assert path == "/generate"
    assert body.keys() == expected.keys()
    assert set(body["sampling_params"]) <= SAMPLING_PARAMS
    assert body["sampling_params"]["max_new_tokens"] == 64


def test_a_vllm_only_parameter_is_refused_before_the_engine() -> None:
    call = Call("s", [1, 2, 3], {**SAMPLING, "bad_words": ["x"]}, None, False)
    with pytest.raises(EngineError) as refused:
        SglangWire("m").request(Replica("http://e"), call, "s-1")
    assert refused.value.status == 400 and refused.value.param == "bad_words"


def test_a_written_reply_reads_as_a_generation() -> None:
    generation = SglangWire("m").parse(_fixture("reply.json"), Replica("http://e"))
    (choice,) = generation.choices
    assert generation.prompt_ids is None  # SGLang does not echo the prompt
    assert choice.token_ids == [13048, 151645]
    assert choice.logprobs == [-0.25, -0.01]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", 151645)
    assert choice.weight_versions == [WeightSpan("default", 0, 2)]
    assert generation.cached_tokens == 0


async def _raw(double: SglangDouble, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=double.url) as http:
        return await http.post("/generate", json=body)


async def test_the_double_answers_in_the_written_shape(sglang_double: SglangDouble) -> None:
    request = _fixture("request.json")
    sglang_double.script(ScriptedCompletion([13048, 151645], stop_reason=151645))
    reply = (await _raw(sglang_double, request)).json()
    assert _shape(reply) == _shape(_fixture("reply.json"))
    sglang_double.script(*(ScriptedCompletion([13048, 151645]) for _ in range(2)))
    params = {**request["sampling_params"], "n": 2}
    streamed = await _raw(sglang_double, {**request, "sampling_params": params, "stream": True})
    first = json.loads(streamed.text.split("\n\n")[0].removeprefix("data: "))
    assert _shape(first) == _shape(_fixture("stream_chunk.json"))
    assert streamed.text.endswith("data: [DONE]\n\n")


async def test_the_double_refuses_like_sglang(sglang_double: SglangDouble) -> None:
    request = _fixture("request.json")
    unknown = {**request, "sampling_params": {"max_tokens": 5}}
    answer = await _raw(sglang_double, unknown)
    assert answer.status_code == 400 and "max_tokens" in answer.json()["error"]["message"]
    over = {**request, "sampling_params": {"max_new_tokens": sglang_double.max_model_len}}
    answer = await _raw(sglang_double, over)
    assert answer.status_code == 400 and "context length" in answer.json()["error"]["message"]


async def test_without_max_new_tokens_the_double_stops_at_128(sglang_double: SglangDouble) -> None:
    sglang_double.script(ScriptedCompletion(list(range(10, 210))))
    request = {**_fixture("request.json"), "sampling_params": {}}
    reply = (await _raw(sglang_double, request)).json()
    assert len(reply["output_ids"]) == 128
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


@pytest.mark.parametrize("incremental", [False, True])
async def test_the_client_reads_both_streaming_modes(
    sglang_double: SglangDouble, incremental: bool
) -> None:
    """Nothing in a chunk says which mode the server runs: the client reads /server_info."""
    sglang_double.incremental = incremental
    story = list(range(100, 120))
    sglang_double.script(ScriptedCompletion(story))
    async with EngineClient([sglang_double.url], model="m", wire=SglangWire("m")) as client:
        events = [e async for e in client.stream("s", [1, 2, 3], SAMPLING)]
    deltas = events[1:]
    assert [t for d in deltas for t in getattr(d, "token_ids", [])] == story
    assert len([lp for d in deltas for lp in getattr(d, "logprobs", [])]) == len(story)


async def test_a_replica_restarted_in_the_other_streaming_mode_is_read_again(
    sglang_double: SglangDouble,
) -> None:
    story = list(range(100, 110))
    async with EngineClient(
        [sglang_double.url], model="m", wire=SglangWire("m"), health_interval_s=0.05
    ) as client:
        sglang_double.incremental = True  # as if restarted with --incremental-streaming-output
        await asyncio.sleep(0.3)  # a few health rounds
        sglang_double.script(ScriptedCompletion(story))
        events = [e async for e in client.stream("s", [1, 2, 3], SAMPLING)]
    assert [t for e in events[1:] for t in getattr(e, "token_ids", [])] == story
