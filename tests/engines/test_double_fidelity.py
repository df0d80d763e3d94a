"""Keeps the test double honest: replaying each recorded real-vLLM exchange against the double,
scripted with the tokens the real engine sampled, must give the same wire shape (keys, value
types, chunk structure, SSE framing) and the same token-level content."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine_double import EngineDouble, ScriptedCompletion

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def request_body(entry: dict[str, Any]) -> dict[str, Any]:
    """The recorded request, with elided long prompts ("<4097 x 9707>") expanded again."""
    body = dict(entry["request"]["body"])
    for key in ("token_ids", "prompt"):
        if isinstance(body.get(key), str):
            count, token = re.fullmatch(r"<(\d+) x (\d+)>", body[key]).groups()  # type: ignore[union-attr]
            body[key] = [int(token)] * int(count)
    return body


def shape(value: Any) -> Any:
    """Keys and JSON types, recursively; a list by the shape of its first element. A map from
    token text to logprob (completions' `top_logprobs`) is keyed by its text, so only its
    value type counts."""
    if isinstance(value, dict) and value and all(isinstance(v, float) for v in value.values()):
        return {"<token>": "float"}
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None if value is None else type(value).__name__


def sse_events(text: str) -> list[str]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")
    assert events[-1] == ""
    assert all(event.startswith("data: ") for event in events[:-1])
    return [event[len("data: ") :] for event in events[:-2]]  # without [DONE]


def scripts_from_choices(choices: list[dict[str, Any]]) -> list[ScriptedCompletion]:
    choices = sorted(choices, key=lambda c: c["index"])
    return [
        ScriptedCompletion(
            c["token_ids"],
            c["finish_reason"],
            c["stop_reason"],
            [entry["logprob"] for entry in c["logprobs"]["content"]] if c.get("logprobs") else None,
        )
        for c in choices
    ]


def scripts_from_stream(chunks: list[dict[str, Any]]) -> list[ScriptedCompletion]:
    merged: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            entry = merged.setdefault(
                c["index"], {"index": c["index"], "token_ids": [], "logprobs": {"content": []}}
            )
            entry["token_ids"] += c["token_ids"]
            entry["logprobs"]["content"] += (c.get("logprobs") or {}).get("content") or []
            entry["finish_reason"] = c["finish_reason"]
            entry["stop_reason"] = c["stop_reason"]
    return scripts_from_choices(list(merged.values()))


def replay(double: EngineDouble, entry: dict[str, Any]) -> httpx.Response:
    return httpx.post(double.url + entry["request"]["path"], json=request_body(entry), timeout=10)


@pytest.mark.parametrize("name", ["generate", "generate_n2", "generate_stop_token", "completions"])
def test_non_streaming_answers_match_real_vllm(engine_double: EngineDouble, name: str) -> None:
    real = load(name)
    if name == "completions":
        engine_double.script(
            *[
                ScriptedCompletion(c["token_ids"], c["finish_reason"], c["stop_reason"])
                for c in real["body"]["choices"]
            ]
        )
    else:
        engine_double.script(*scripts_from_choices(real["body"]["choices"]))

    response = replay(engine_double, real)

    assert response.status_code == real["status"] == 200
    assert response.headers["content-type"] == real["content_type"]
    body = response.json()
    assert shape(body) == shape(real["body"])
    for mine, theirs in zip(body["choices"], real["body"]["choices"], strict=True):
        for key in ("index", "token_ids", "finish_reason", "stop_reason"):
            assert mine[key] == theirs[key], key
    if name == "completions":
        assert (
            body["choices"][0]["prompt_token_ids"] == real["body"]["choices"][0]["prompt_token_ids"]
        )
    else:
        assert body["prompt_token_ids"] == real["body"]["prompt_token_ids"]


@pytest.mark.parametrize(
    "name", ["generate_stream", "generate_stream_n2", "generate_stream_eos", "completions_stream"]
)
def test_streams_match_real_vllm(engine_double: EngineDouble, name: str) -> None:
    real = load(name)
    real_chunks = [json.loads(event) for event in sse_events(real["sse"])]
    if name == "completions_stream":
        engine_double.script(
            ScriptedCompletion(
                [t for c in real_chunks for t in c["choices"][0]["token_ids"]],
                real_chunks[-1]["choices"][0]["finish_reason"],
                real_chunks[-1]["choices"][0]["stop_reason"],
            )
        )
    else:
        engine_double.script(*scripts_from_stream(real_chunks))

    response = replay(engine_double, real)

    assert response.status_code == real["status"] == 200
    assert response.headers["content-type"].split(";")[0] == real["content_type"]
    chunks = [json.loads(event) for event in sse_events(response.text)]
    assert len(chunks) == len(real_chunks)
    # Every chunk carries one choice and one token; the prompt ids ride on the first chunk.
    assert all(len(c["choices"]) == 1 and len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
    prompt_key_chunks = [
        i for i, c in enumerate(real_chunks) if c.get("prompt_token_ids") is not None
    ]
    if name != "completions_stream":
        assert prompt_key_chunks == [0]
        assert [i for i, c in enumerate(chunks) if "prompt_token_ids" in c] == [0]
        assert chunks[0]["prompt_token_ids"] == real_chunks[0]["prompt_token_ids"]

    def by_choice(stream: list[dict[str, Any]]) -> dict[int, list[Any]]:
        grouped: dict[int, list[Any]] = {}
        for chunk in stream:
            rest = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
            grouped.setdefault(chunk["choices"][0]["index"], []).append(
                (
                    shape(rest),
                    chunk["choices"][0]["token_ids"],
                    chunk["choices"][0]["finish_reason"],
                    chunk["choices"][0]["stop_reason"],
                )
            )
        return grouped

    assert by_choice(chunks) == by_choice(real_chunks)


@pytest.mark.parametrize(
    "name",
    [
        "error_oov",
        "error_too_long",
        "error_no_room",
        "error_bad_sampling",
        "error_unknown_model",
        "error_negative_id",
    ],
)
def test_error_answers_match_real_vllm(engine_double: EngineDouble, name: str) -> None:
    real = load(name)
    response = replay(engine_double, real)
    assert response.status_code == real["status"]
    body = response.json()
    assert shape(body) == shape(real["body"])
    mine, theirs = body["error"], real["body"]["error"]
    assert (mine["type"], mine["param"], mine["code"]) == (
        theirs["type"],
        theirs["param"],
        theirs["code"],
    )
    if name != "error_negative_id":  # pydantic's full validation dump is not reproduced
        assert mine["message"] == theirs["message"]


@pytest.mark.parametrize("name", ["error_oov_stream", "error_too_long_stream"])
def test_streamed_errors_are_byte_identical(engine_double: EngineDouble, name: str) -> None:
    real = load(name)
    response = replay(engine_double, real)
    assert response.status_code == real["status"] == 200
    assert response.text == real["sse"]


def test_missing_token_endpoint_matches_real_vllm(engine_double: EngineDouble) -> None:
    real = load("error_missing_route")
    engine_double.generate_endpoint = False
    response = httpx.post(engine_double.url + "/inference/v1/generate", json={})
    assert (response.status_code, response.json()) == (real["status"], real["body"])


@pytest.mark.parametrize("name", ["health", "models"])
def test_health_and_models_match_real_vllm(engine_double: EngineDouble, name: str) -> None:
    real = load(name)
    response = httpx.get(engine_double.url + real["request"]["path"])
    assert response.status_code == real["status"]
    body = response.json() if response.content else None
    assert shape(body) == shape(real["body"])
