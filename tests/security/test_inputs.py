"""Unclean input gets a clean answer (issue 33, class 4): a value the engine or a store would
fail on is a 400 in the API's own error shape naming the parameter, never a 500 or a
traceback, and the refused request leaves the session it named exactly as it was. Against
the live server with each store, since the stores once answered the same request differently
(the embedded one accepted what Redis failed on)."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.security.conftest import (
    ADMIN_KEY,
    LiveServer,
    assert_responsive,
    health_watch,
    start_server,
    stop_server,
)

SESSION = "inputs"
USER = [{"role": "user", "content": "hi"}]
HUGE = 2**80
"""Wider than 64 bits: what vLLM's int64 tensors and the engine request's encoder refuse."""

TURNS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": USER}),
    "messages": ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": 5}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi"}),
    "completions": ("/v1/completions", {"model": "m", "prompt": [9707, 11]}),
    "generate": ("/inference/v1/generate", {"token_ids": [9707, 11], "sampling_params": {}}),
}


@pytest.fixture(scope="module", params=["memory", "redis"])
def server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    double: EngineDouble,
) -> Iterator[LiveServer]:
    args = ["--admin-key", ADMIN_KEY]
    if request.param == "redis":
        args += ["--redis-url", request.getfixturevalue("redis_server")]
    live = start_server(tmp_path_factory.mktemp(request.param), double, *args)
    try:
        key = live.create(SESSION)
        with live.client(key) as client:
            body = TURNS["chat"][1]
            assert client.post(f"/sessions/{SESSION}/v1/chat/completions", json=body).is_success
        yield live
    finally:
        stop_server(live)


@pytest.fixture(autouse=True)
def responsive(request: pytest.FixtureRequest) -> Iterator[None]:
    """/healthz answers within 100 ms while each unclean input is answered (by the tests of
    the shared `server`: asking for it here would run every other test once per store)."""
    if "server" not in request.fixturenames:
        yield
        return
    with health_watch(request.getfixturevalue("server")) as health:
        yield
    assert_responsive(health)


def _snapshot(server: LiveServer, session_id: str = SESSION) -> Any:
    with server.admin() as admin:
        summary = admin.get(f"/sessions/{session_id}")
        trajectory = admin.get(f"/sessions/{session_id}/trajectory")
    return summary.status_code, summary.text, trajectory.status_code, trajectory.text


def _raw(body: dict[str, Any]) -> bytes:
    """JSON as Python writes it: `Infinity` and `NaN` for non-finite floats (what a client
    built on `json.dumps` sends)."""
    return json.dumps(body).encode()


def _post(server: LiveServer, path: str, body: bytes, key: str | None = None) -> httpx.Response:
    with server.client(key or server.admin_key) as client:
        return client.post(path, content=body, headers={"content-type": "application/json"})


def _assert_400(response: httpx.Response, path: str, param: str | None) -> None:
    assert response.status_code == 400, response.text
    assert "Traceback" not in response.text
    payload = response.json()
    if path.endswith("/messages"):
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["message"]
        return
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"]) == (400, "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error


SAMPLING_CASES = [
    ("chat", "seed", HUGE, "seed"),
    ("chat", "seed", -HUGE, "seed"),
    ("chat", "top_k", HUGE, "top_k"),
    ("chat", "max_tokens", HUGE, "max_tokens"),
    ("chat", "max_completion_tokens", HUGE, "max_completion_tokens"),
    ("chat", "n", HUGE, "n"),
    ("chat", "temperature", float("inf"), "temperature"),
    ("chat", "temperature", float("nan"), "temperature"),
    ("chat", "repetition_penalty", float("inf"), "repetition_penalty"),
    ("messages", "top_k", HUGE, None),
    ("messages", "max_tokens", HUGE, None),
    ("responses", "max_output_tokens", HUGE, "max_output_tokens"),
    ("completions", "seed", HUGE, "seed"),
    ("completions", "max_tokens", HUGE, "max_tokens"),
    ("completions", "temperature", float("inf"), "temperature"),
    ("generate", "seed", HUGE, "sampling_params.seed"),
    ("generate", "top_k", HUGE, "sampling_params.top_k"),
    ("generate", "max_tokens", HUGE, "sampling_params.max_tokens"),
    ("generate", "min_tokens", HUGE, "sampling_params.min_tokens"),
    ("generate", "temperature", float("inf"), "sampling_params.temperature"),
    ("generate", "temperature", float("nan"), "sampling_params.temperature"),
    ("generate", "stop_token_ids", [HUGE], "sampling_params.stop_token_ids.0"),
]


@pytest.mark.parametrize(("api", "name", "value", "param"), SAMPLING_CASES)
def test_sampling_beyond_the_engines_range_is_400_and_stores_nothing(
    server: LiveServer, api: str, name: str, value: Any, param: str | None
) -> None:
    path, base = TURNS[api]
    body = json.loads(json.dumps(base))
    if api == "generate":
        body["sampling_params"][name] = value
    else:
        body[name] = value
    before = _snapshot(server)
    response = _post(server, f"/sessions/{SESSION}{path}", _raw(body))
    _assert_400(response, path, param)
    assert _snapshot(server) == before


def test_a_huge_float_literal_is_refused_not_sent_as_null(server: LiveServer) -> None:
    """`1e400` parses as infinity: serialised for the engine it would be `null`."""
    path, base = TURNS["chat"]
    body = _raw(base)[:-1] + b', "temperature": 1e400}'
    before = _snapshot(server)
    _assert_400(_post(server, f"/sessions/{SESSION}{path}", body), path, "temperature")
    assert _snapshot(server) == before


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"seed": HUGE}, "sampling.seed"),
        ({"top_k": -HUGE}, "sampling.top_k"),
        ({"temperature": "hot"}, "sampling.temperature"),
        ({"temperature": float("inf")}, "sampling.temperature"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"n": 1e9}, "sampling.n"),
    ],
)
def test_session_sampling_overrides_are_checked_at_creation(
    server: LiveServer, sampling: dict[str, Any], param: str
) -> None:
    session_id = f"ovr-{zlib.crc32(repr(sampling).encode()):08x}"
    response = _post(server, "/sessions", _raw({"id": session_id, "sampling": sampling}))
    _assert_400(response, "/sessions", param)
    assert _snapshot(server, session_id)[0] == 404


def test_session_sampling_overrides_in_range_still_apply(server: LiveServer) -> None:
    """The check refuses what the engine cannot take, not the overrides users set."""
    sampling = {"seed": 2**63 - 1, "temperature": 0.25, "top_k": -1, "stop": ["x"]}
    body = {"id": "ovr-ok", "sampling": sampling}
    with server.admin() as admin:
        created = admin.post("/sessions", json=body)
        assert created.status_code == 201, created.text
        assert created.json()["sampling"] == sampling
        assert admin.delete("/sessions/ovr-ok").is_success


@pytest.mark.parametrize("ttl", [0, -5, 10**12, HUGE, 1.5, float("nan"), float("inf")])
def test_ttl_out_of_range_is_400_on_both_stores(server: LiveServer, ttl: Any) -> None:
    session_id = f"ttl-{zlib.crc32(repr(ttl).encode()):08x}"  # one per case: independent
    response = _post(server, "/sessions", _raw({"id": session_id, "ttl_seconds": ttl}))
    _assert_400(response, "/sessions", "ttl_seconds")
    assert _snapshot(server, session_id)[0] == 404


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "NaN"])
@pytest.mark.parametrize("name", ["since", "until"])
def test_list_time_filters_must_be_finite(server: LiveServer, name: str, value: str) -> None:
    with server.admin() as admin:
        response = admin.get("/sessions", params={name: value})
    _assert_400(response, "/sessions", f"query.{name}")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["since", "until", "min_weight_version"])
def test_export_filters_must_be_finite(server: LiveServer, name: str, value: float) -> None:
    response = _post(server, "/sessions/export", _raw({name: value}))
    _assert_400(response, "/sessions/export", name)


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _tool_turn(api: str, arguments: str) -> dict[str, Any]:
    """A turn whose history holds an assistant tool call with `arguments` (JSON text)."""
    if api == "chat":
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {
            "model": "m",
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
            ],
        }
    if api == "responses":
        return {
            "model": "m",
            "input": [
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
            ],
        }
    tool_use = {"type": "tool_use", "id": "t1", "name": "f", "input": json.loads(arguments)}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "x"}
    return {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            *USER,
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [result]},
        ],
    }


@pytest.mark.parametrize(
    ("api", "depth"),
    [("chat", 5000), ("chat", 150), ("responses", 5000), ("messages", 150)],
)
def test_deeply_nested_tool_call_arguments_are_400(
    server: LiveServer, api: str, depth: int
) -> None:
    """Arguments as JSON text are parsed after the body (any depth reaches them); as a JSON
    value they are bounded only by the body parser's limit, above the server's."""
    path = TURNS[api][0]
    before = _snapshot(server)
    body = _raw(_tool_turn(api, _nested(depth)))
    response = _post(server, f"/sessions/{SESSION}{path}", body)
    param = None if api == "messages" else "messages[1].tool_calls[0].arguments"
    _assert_400(response, path, param)
    assert "nest deeper than 128 levels" in response.text
    assert _snapshot(server) == before


def test_tool_call_arguments_within_the_bound_still_work(server: LiveServer) -> None:
    path = TURNS["chat"][0]
    with server.admin() as admin:
        response = admin.post(f"/sessions/nest-ok{path}", json=_tool_turn("chat", _nested(100)))
        assert response.status_code == 200, response.text
        admin.delete("/sessions/nest-ok")


def test_deeply_nested_metadata_is_refused_before_it_is_stored(server: LiveServer) -> None:
    body = b'{"id": "meta-deep", "metadata": ' + _nested(300).encode() + b"}"
    _assert_400(_post(server, "/sessions", body), "/sessions", "metadata")
    assert _snapshot(server, "meta-deep")[0] == 404
    before = _snapshot(server)
    finish = b'{"metadata": ' + _nested(300).encode() + b"}"
    _assert_400(_post(server, f"/sessions/{SESSION}/finish", finish), "/finish", "metadata")
    assert _snapshot(server) == before


def _faults(server: LiveServer, reason: str) -> float:
    with server.admin() as admin:
        text = admin.get("/metrics").text
    line = f'tokenkeep_engine_reply_faults_total{{reason="{reason}"}} '
    found = [row for row in text.splitlines() if row.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


def _assert_engine_fault(response: httpx.Response, words: str) -> None:
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"]) == (502, "EngineProtocolError")
    assert words in error["message"] and "nothing was stored" in error["message"]


@pytest.mark.parametrize(
    ("reply", "reason", "words"),
    [
        ([-1, 151645], "vocabulary", "outside the vocabulary"),
        ([562, 10**6, 151645], "vocabulary", "outside the vocabulary"),
        ([562] * 40, "max_tokens", "more than max_tokens (5)"),
    ],
)
def test_an_engine_reply_it_could_not_have_sampled_is_502_and_stores_nothing(
    server: LiveServer,
    double: EngineDouble,
    reply: list[int],
    reason: str,
    words: str,
) -> None:

    before, counted = _snapshot(server), _faults(server, reason)
    double.script(ScriptedCompletion(reply, overrun=True))
    body = {"model": "m", "messages": [{"role": "user", "content": "fault"}], "max_tokens": 5}
    with server.admin() as admin:
        response = admin.post(f"/sessions/{SESSION}/v1/chat/completions", json=body)
    _assert_engine_fault(response, words)
    assert _snapshot(server) == before
    assert _faults(server, reason) == counted + 1


def test_a_stream_past_max_tokens_is_cut_and_stores_nothing(
    server: LiveServer, double: EngineDouble
) -> None:
    """The engine keeps sending: the client gets at most max_tokens of it, then an in-band
    engine error, and the engine's stream is closed."""

    before, counted = _snapshot(server), _faults(server, "max_tokens")
    double.script(ScriptedCompletion([562] * 200, overrun=True))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "stream fault"}],
        "max_tokens": 3,
        "stream": True,
        "return_token_ids": True,
    }
    events = []
    with (
        server.admin() as admin,
        admin.stream("POST", f"/sessions/{SESSION}/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    relayed = [t for e in events for c in e.get("choices", ()) for t in c.get("token_ids") or ()]
    assert len(relayed) <= 3
    errors = [e["error"] for e in events if "error" in e]
    assert errors and "more than max_tokens (3)" in errors[0]["message"], events
    assert _snapshot(server) == before
    assert _faults(server, "max_tokens") == counted + 1


def test_server_wide_sampling_overrides_are_checked_at_start(
    tmp_path_factory: pytest.TempPathFactory, double: EngineDouble
) -> None:
    env = {"TOKENKEEP_SAMPLING_OVERRIDES": json.dumps({"seed": HUGE})}
    try:
        live = start_server(tmp_path_factory.mktemp("overrides"), double, env=env)
    except RuntimeError as exc:
        assert "tokenkeep serve: sampling_overrides.seed" in str(exc)
        assert "Traceback" not in str(exc)
    else:
        stop_server(live)
        pytest.fail("the server started with a seed that every turn would fail on")
