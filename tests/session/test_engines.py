"""The session tiers on each engine's wire: the vLLM double and the SGLang double (cumulative
and incremental streaming), both stores. What a harness and a trainer see must not depend on
which engine samples: every turn extends the stored tokens, streamed and whole replies agree,
n > 1 keeps every sample, an abort stops the engine's request, and the export holds exactly
what the engine sampled."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from session_server.cli import _serve_parser
from session_server.engine_wire.base import Call, EngineError, Replica
from session_server.engine_wire.sglang import SglangWire
from session_server.settings import Settings
from session_server.splice import ChatModel
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.engine_double_sglang import SglangDouble
from tests.session.adversarial import END, SCENARIOS, Scenario, tokens
from tests.session.conftest import Stack, make_stack
from tests.session.test_contiguity import run_two_turns
from tests.suffix_reference import assert_suffix
from tests.trajectory_values import assert_trajectory_values

ENGINES = ["vllm", "sglang", "sglang-incremental"]
USER = [{"role": "user", "content": "Write a long story."}]


def _double(request: pytest.FixtureRequest, engine: str) -> EngineDouble:
    if engine == "vllm":
        return request.getfixturevalue("engine_double")
    double: SglangDouble = request.getfixturevalue("sglang_double")
    double.incremental = engine == "sglang-incremental"  # read by the client at start
    return double


def _stack(
    request: pytest.FixtureRequest, engine: str, store: str, **settings: Any
) -> Iterator[Stack]:
    double = _double(request, engine)
    kind = "vllm" if engine == "vllm" else "sglang"
    yield from make_stack(
        request.getfixturevalue("qwen3_model"),
        double,
        store,
        request.getfixturevalue("redis_server") if store == "redis" else None,
        engine_kind=kind,
        **settings,
    )


@pytest.fixture(params=[(e, s) for e in ENGINES for s in ("memory", "redis")], ids=str)
def engine_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    engine, store = request.param
    yield from _stack(request, engine, store)


@pytest.fixture
def sglang_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    yield from _stack(request, "sglang", "memory")


TOOL_SCENARIOS = [s for s in SCENARIOS if s.tools]


@pytest.mark.parametrize("scenario", TOOL_SCENARIOS, ids=[s.name for s in TOOL_SCENARIOS])
def test_a_tool_session_extends_every_turn(engine_stack: Stack, scenario: Scenario) -> None:
    stack = engine_stack
    run = run_two_turns(stack, scenario, f"eng-{scenario.name}")
    stored = run["prompt1"] + run["sampled"]
    assert_suffix(stack.model, run["prompt2"], stored, run["sampled"], run["history"], run["tools"])
    assert run["second"].model_extra["tokenkeep"]["kind"] == "extend"
    trajectory = stack.trajectory(f"eng-{scenario.name}")
    (branch,) = trajectory["branches"]
    assert len(branch["segments"]) == 1  # no break
    checked = assert_trajectory_values(trajectory, stack.double.samples, every_sample=True)
    assert checked == len(run["sampled"]) + len(run["second"].choices[0].token_ids)


def _chat(stack: Stack, session_id: str, stream: bool, n: int = 1) -> dict[str, Any]:
    """One chat turn; streamed chunks folded into the shape of a whole reply."""
    body = {
        "model": "m",
        "messages": USER,
        "n": n,
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
        "stream": stream,
    }
    client = stack.openai(session_id)
    if not stream:
        reply = client.chat.completions.create(**body)  # type: ignore[call-overload]
        return {
            c.index: (c.message.content, c.token_ids, [lp.logprob for lp in c.logprobs.content])
            for c in reply.choices
        }
    folded: dict[int, tuple[str, list[int], list[float]]] = {}
    for chunk in client.chat.completions.create(**body):  # type: ignore[call-overload]
        for c in chunk.choices:
            text, ids, lps = folded.get(c.index, ("", [], []))
            extra = c.model_extra or {}
            folded[c.index] = (
                text + (c.delta.content or ""),
                ids + list(extra.get("token_ids") or []),
                lps + [lp.logprob for lp in (c.logprobs.content if c.logprobs else None) or ()],
            )
    return folded


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_and_whole_replies_are_the_same_samples(engine_stack: Stack, n: int) -> None:
    stack = engine_stack
    stories = [tokens(stack.model, *(f" w{k}{i}" for i in range(6)), END) for k in range(n)]
    replies = []
    for stream in (False, True):
        stack.double.script(*(ScriptedCompletion(story) for story in stories))
        replies.append(_chat(stack, f"same-{stream}", stream, n))
    whole, streamed = replies
    assert whole == streamed
    assert sorted(ids for _, ids, _ in whole.values()) == sorted(stories)
    for session_id in ("same-False", "same-True"):
        trajectory = stack.trajectory(session_id)
        assert len(trajectory["branches"]) == n  # every sample kept
        assert_trajectory_values(trajectory, stack.double.samples)


def test_sglang_requests_use_only_sglang_names(sglang_stack: Stack) -> None:
    """The body is SGLang's: input_ids, its own sampling names, max_new_tokens always set,
    the stop token kept, the sampled tokens' logprobs asked for."""
    stack = sglang_stack
    stack.double.script(ScriptedCompletion(tokens(stack.model, "Hi", END)))
    client = stack.openai("names")
    client.chat.completions.create(model="m", messages=USER, seed=7, max_tokens=50)  # type: ignore[arg-type]
    (request,) = stack.double.requests
    body = request.body
    assert body["input_ids"] == request.prompt_ids and "token_ids" not in body
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"]) == (
        True,
        -1,
        0,
    )
    params = body["sampling_params"]
    assert params["max_new_tokens"] == 50 and params["sampling_seed"] == 7
    assert params["no_stop_trim"] is True and params["skip_special_tokens"] is False
    assert "max_tokens" not in params and "logprobs" not in params and "seed" not in params


def test_sglang_max_new_tokens_is_clamped_to_the_engines_context(
    request: pytest.FixtureRequest, sglang_double: SglangDouble
) -> None:
    """tokenkeep's own context (here larger than the engine's) would let a request through
    that SGLang refuses: the client clamps to the context the server reports instead."""
    sglang_double.max_model_len = 1024
    try:
        for stack in _stack(request, "sglang", "memory", context_length=8192):
            stack.double.script(ScriptedCompletion(tokens(stack.model, "Hi", END)))
            reply = stack.openai("clamp").chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
            assert reply.choices[0].finish_reason == "stop"
            (sent,) = stack.double.requests
            assert sent.sampling["max_new_tokens"] == 1024 - len(sent.prompt_ids)
    finally:
        sglang_double.max_model_len = 4096


def test_sglang_refuses_a_parameter_it_has_no_name_for(sglang_stack: Stack) -> None:
    """A sampling parameter outside vLLM's own names is a 400 at session creation (nothing
    stored, `sampling.SamplingParams`); one the SGLang wire has no name for, should it ever
    reach it, is a 400 in the API's shape before the engine is called."""
    stack = sglang_stack
    with stack.http() as http:
        created = http.post("/sessions", json={"sampling": {"bad_words": ["x"]}})
        assert created.status_code == 400
        assert "bad_words" in created.json()["error"]["message"]
    wire = SglangWire(stack.double.model)
    call = Call("s", [1, 2, 3], {"bad_words": ["x"], "max_tokens": 5}, None, False)
    with pytest.raises(EngineError) as refused:
        wire.request(Replica(stack.double.url), call, "s-1")
    assert refused.value.status == 400
    assert "bad_words" in refused.value.message
    assert stack.double.requests == []


def _when_engine_has(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(stack.double.requests) < count:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)


def _abort(stack: Stack, session_id: str) -> httpx.Response:
    with stack.http() as client:
        return client.post(f"/sessions/{session_id}/abort")


def _aborted(double: SglangDouble, expected: list[str]) -> None:
    deadline = time.monotonic() + 5
    while sorted(double.aborted) != sorted(expected):
        assert time.monotonic() < deadline, f"abort_request got {double.aborted}"
        time.sleep(0.02)


@pytest.mark.parametrize("n", [1, 2])
def test_sglang_abort_stops_a_stream_by_its_rid(sglang_stack: Stack, n: int) -> None:
    stack = sglang_stack
    double = stack.double
    assert isinstance(double, SglangDouble)
    story = tokens(stack.model, *(f" word{i}" for i in range(40)), END)
    double.script(*(ScriptedCompletion(story) for _ in range(n)))
    double.chunk_delay_s = 0.1
    body = {"model": "m", "messages": USER, "stream": True, "n": n}
    with (
        stack.http() as client,
        client.stream("POST", "/sessions/cut/v1/chat/completions", json=body) as response,
    ):
        data = 0
        for line in response.iter_lines():
            data += line.startswith("data:")
            if data == 2:
                threading.Thread(target=_abort, args=(stack, "cut"), daemon=True).start()
    rid = double.requests[0].body["rid"]
    _aborted(double, [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)])  # never "*"
    turns = [
        t for b in stack.trajectory("cut")["branches"] for s in b["segments"] for t in s["turns"]
    ]
    assert {t["finish_reason"] for t in turns} == {"abort"}


def test_sglang_abort_stops_a_whole_request_by_its_rid(sglang_stack: Stack) -> None:
    stack = sglang_stack
    double = stack.double
    assert isinstance(double, SglangDouble)
    double.script(ScriptedCompletion(tokens(stack.model, "Once", END)))
    double.latency_s = 3.0
    try:
        result: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: result.append(
                stack.http().post(
                    "/sessions/cut/v1/chat/completions", json={"model": "m", "messages": USER}
                )
            )
        )
        worker.start()
        _when_engine_has(stack, 1)
        assert _abort(stack, "cut").json()["aborted"] == 1
        worker.join(10)
        assert result[0].status_code == 400 and result[0].json()["error"]["type"] == "aborted"
        _aborted(double, [double.requests[0].body["rid"]])
    finally:
        double.latency_s = 0.0


def test_sglang_reports_no_prompt_echo(sglang_stack: Stack, qwen3_model: ChatModel) -> None:
    """SGLang does not echo the prompt: the turn is stored without the proof check (which
    would need it), and its cached_tokens come from meta_info."""
    stack = sglang_stack
    stack.double.script(ScriptedCompletion(tokens(qwen3_model, "Hi", END)))
    reply = stack.openai("echo").chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "Hi"
    assert_trajectory_values(stack.trajectory("echo"), stack.double.samples, every_sample=True)


def test_the_engine_kind_is_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenkeep serve --engine sglang` and TOKENKEEP_ENGINE_KIND pick the wire; anything
    but vllm or sglang is refused."""
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--engine", "sglang", "--engine-url", "http://e:1", "--tokenizer", "t"]
    )
    assert args.engine_kind == "sglang"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--engine", "tgi"])
    assert Settings().engine_kind == "vllm"
    monkeypatch.setenv("TOKENKEEP_ENGINE_KIND", "sglang")
    assert Settings().engine_kind == "sglang"
    monkeypatch.setenv("TOKENKEEP_ENGINE_KIND", "tgi")
    with pytest.raises(ValidationError):
        Settings()


@pytest.mark.parametrize(
    ("engine", "lacks"),
    [("vllm", []), ("sglang", ["prompt_echo", "routed_experts", "images", "reasoning_ended"])],
)
def test_a_session_says_what_its_engine_cannot_give(
    request: pytest.FixtureRequest, engine: str, lacks: list[str]
) -> None:
    """`GET /sessions/{id}` names the engine and what it does not give that vLLM does (the
    README's table, where a trainer reads the session's counters)."""
    for stack in _stack(request, engine, "memory"):
        stack.double.script(ScriptedCompletion(tokens(stack.model, "Hi", END)))
        stack.openai("told").chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
        with stack.http() as http:
            described = http.get("/sessions/told").json()
        assert described["engine"] == {"kind": engine, "lacks": lacks}
