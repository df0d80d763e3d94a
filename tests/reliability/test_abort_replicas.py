"""`POST /sessions/{id}/abort` received by one session server cuts that session's generations
in flight on another one sharing its Redis.

Real processes on loopback: one redis-server, two `tokenkeep serve` processes (A and B). The
engine is the vLLM-protocol double (tests/engine_double.py, a TEST DOUBLE: the real vLLM CPU
engine cannot be slowed down on demand) served in this process, so the test sees whether the
engine's stream was left before its end (vLLM aborts such a request). The abort is recorded in
Redis by A; B, which generates, reads the recorded aborts while it has generations in flight
and cuts its own: each request is answered with an `aborted` error in its API's shape, its cut
turn stored with finish_reason "abort"; another session on B is untouched."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine_double import EngineDouble
from tests.redis_server import _free_loopback_port
from tests.reliability.engine_proc import _answer
from tests.reliability.harness import MODEL, REPO, Redis, Server
from tests.reliability.test_faults import _running

pytestmark = pytest.mark.reliability

RESULTS = REPO / "bench" / "results" / "abort.md"
USER = [{"role": "user", "content": "Write a long story."}]


@pytest.fixture
def engine() -> Iterator[EngineDouble]:
    double = EngineDouble(port=_free_loopback_port(), default=_answer)
    double.start()
    yield double
    double.stop()


@pytest.fixture
def servers(tmp_path: Path, engine: EngineDouble) -> Iterator[tuple[str, str]]:
    redis = Redis(tmp_path)
    a, b = (Server(tmp_path, redis.url, [engine.url]) for _ in range(2))
    try:
        with _running(a, b):
            yield a.url, b.url
            for server in (a, b):
                assert "Traceback" not in server.log()
    finally:
        redis.stop()


def _post(url: str, path: str, body: dict[str, Any]) -> Callable[[], httpx.Response]:
    def send() -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=60)

    return send


def _when_engine_has(engine: EngineDouble, count: int) -> None:
    deadline = time.monotonic() + 20
    while len(engine.requests) < count:
        assert time.monotonic() < deadline, "the requests never reached the engine"
        time.sleep(0.02)


def _turns(url: str, session_id: str) -> list[dict[str, Any]]:
    trajectory = httpx.get(f"{url}/sessions/{session_id}/trajectory", timeout=30).json()
    return [
        turn
        for branch in trajectory["branches"]
        for segment in branch["segments"]
        for turn in segment["turns"]
    ]


def _record(figures: dict[str, float]) -> None:
    """bench/results/abort.md, when asked (`TOKENKEEP_RECORD_RESULTS=1`)."""
    if os.environ.get("TOKENKEEP_RECORD_RESULTS") != "1":
        return
    rows = "".join(f"| {name} | {seconds:.3f} |\n" for name, seconds in figures.items())
    RESULTS.write_text(
        "# Abort latency across session-server replicas\n\n"
        "`TOKENKEEP_RECORD_RESULTS=1 pytest tests/reliability/test_abort_replicas.py`: two\n"
        "`tokenkeep serve` processes on one redis-server, engine double; the abort is sent to\n"
        "server A, the generations run on server B (it polls the recorded aborts every\n"
        "0.25 s while it generates). Seconds from sending the abort to the cut request's\n"
        f"answer (measured {time.strftime('%Y-%m-%d')}, 2-core machine shared with other\n"
        "work).\n\n| request cut on B | seconds |\n|---|---|\n" + rows
    )


def test_abort_through_one_replica_cuts_generations_on_the_other(
    servers: tuple[str, str], engine: EngineDouble
) -> None:
    a, b = servers
    figures: dict[str, float] = {}
    # A chat stream on B, mid-flight (one chunk every 0.5 s), cut by an abort sent to A.
    engine.chunk_delay_s = 0.5
    try:
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(
                _post(
                    b, "/sessions/bystander/v1/chat/completions", {"model": MODEL, "messages": USER}
                )
            )
            lines: list[str] = []
            aborted: list[httpx.Response] = []
            body = {"model": MODEL, "messages": USER, "stream": True}
            with httpx.stream(
                "POST", f"{b}/sessions/cut/v1/chat/completions", json=body, timeout=60
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    lines.append(line)
                    if sum(x.startswith("data:") for x in lines) == 2 and not aborted:
                        started = time.monotonic()
                        aborted.append(httpx.post(f"{a}/sessions/cut/abort", timeout=30))
            figures["Chat stream (error in-band)"] = time.monotonic() - started
            assert other.result().status_code == 200  # the other session's turn is served
    finally:
        engine.chunk_delay_s = 0.0
    # A received it but generates nothing of the session: it cut none itself.
    assert aborted[0].status_code == 200 and aborted[0].json()["aborted"] == 0
    assert figures["Chat stream (error in-band)"] < 3.0  # the stream had ~4 s to go
    events = [line for line in lines if line]
    assert '"aborted"' in events[-1] or (events[-1] == "data: [DONE]" and '"aborted"' in events[-2])
    (turn,) = _turns(a, "cut")
    assert turn["finish_reason"] == "abort"
    assert turn["completion_span"][1] > turn["completion_span"][0]  # what arrived is kept
    assert _turns(a, "bystander")[0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 5
    while engine.streams_abandoned < 1:  # B left the engine's stream: vLLM aborts it
        assert time.monotonic() < deadline
        time.sleep(0.05)

    # Non-streamed Chat and Anthropic Messages requests of one session, both on B.
    engine.latency_s = 6.0
    seen = len(engine.requests)
    try:
        with ThreadPoolExecutor(2) as pool:
            chat: Future[httpx.Response] = pool.submit(
                _post(b, "/sessions/cut/v1/chat/completions", {"model": MODEL, "messages": USER})
            )
            messages: Future[httpx.Response] = pool.submit(
                _post(
                    b,
                    "/sessions/cut/v1/messages",
                    {"model": MODEL, "max_tokens": 64, "messages": USER},
                )
            )
            _when_engine_has(engine, seen + 2)
            started = time.monotonic()
            ended: dict[str, float] = {}
            for name, future in (("Chat", chat), ("Messages", messages)):
                future.add_done_callback(lambda _, n=name: ended.setdefault(n, time.monotonic()))
            threading.Thread(
                target=httpx.post, args=(f"{a}/sessions/cut/abort",), daemon=True
            ).start()
            chat_answer, messages_answer = chat.result(), messages.result()
    finally:
        engine.latency_s = 0.0
    for name in ("Chat", "Messages"):
        figures[f"{name} (400)"] = ended[name] - started
        assert figures[f"{name} (400)"] < 3.0  # the engine would have answered after 6 s
    assert chat_answer.status_code == 400
    assert chat_answer.json()["error"]["type"] == "aborted"
    assert messages_answer.status_code == 400
    assert messages_answer.json()["type"] == "error"
    assert messages_answer.json()["error"]["type"] == "invalid_request_error"
    cut = [t for t in _turns(a, "cut") if t["finish_reason"] == "abort"]
    assert len(cut) == 3

    # The session stays usable through either server; finished, nothing more is aborted.
    again = _post(b, "/sessions/cut/v1/chat/completions", {"model": MODEL, "messages": USER})()
    assert again.status_code == 200
    done = httpx.post(f"{a}/sessions/cut/abort", json={"finish": True}, timeout=30)
    assert done.json()["finish"]["status"] == "aborted"
    refused = httpx.post(f"{b}/sessions/cut/abort", timeout=30)
    assert refused.status_code == 409 and refused.json()["error"]["message"]
    assert len(_turns(a, "cut")) == 4
    _record(figures)


@pytest.fixture
def one_slot_b(tmp_path: Path, engine: EngineDouble) -> Iterator[tuple[str, str]]:
    """Servers A and B on one redis-server; B runs one generation at a time (the rest
    queue for its slot)."""
    redis = Redis(tmp_path)
    a = Server(tmp_path, redis.url, [engine.url])
    b = Server(tmp_path, redis.url, [engine.url], "--max-inflight", "1")
    try:
        with _running(a, b):
            yield a.url, b.url
            for server in (a, b):
                assert "Traceback" not in server.log()
    finally:
        redis.stop()


def test_abort_through_one_replica_cuts_requests_queued_on_the_other(
    one_slot_b: tuple[str, str], engine: EngineDouble
) -> None:
    """B's only slot is busy with another session; requests of the aborted session queued
    behind it on B are answered with the abort error when they get the slot (B read the
    abort while it generated), without reaching the engine; later requests are served."""
    a, b = one_slot_b
    chat = {"model": MODEL, "messages": USER}
    assert _post(b, "/sessions/queued/v1/chat/completions", chat)().status_code == 200
    seen = len(engine.requests)
    engine.latency_s = 2.0
    try:
        with ThreadPoolExecutor(3) as pool:
            busy = pool.submit(_post(b, "/sessions/busy/v1/chat/completions", chat))
            _when_engine_has(engine, seen + 1)
            queued = [
                pool.submit(_post(b, "/sessions/queued/v1/chat/completions", body))
                for body in (chat, {**chat, "stream": True})
            ]
            deadline = time.monotonic() + 10
            while "tokenkeep_queued_requests 2.0" not in httpx.get(f"{b}/metrics").text:
                assert time.monotonic() < deadline, "the requests never queued on B"
                time.sleep(0.02)
            assert httpx.post(f"{a}/sessions/queued/abort", timeout=30).status_code == 200
            assert busy.result().status_code == 200
            answers = [future.result() for future in queued]
    finally:
        engine.latency_s = 0.0
    for answer in answers:
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "aborted"
        assert "before it reached the engine" in answer.json()["error"]["message"]
    assert len(engine.requests) == seen + 1  # only the other session's turn
    assert len(_turns(a, "queued")) == 1
    assert _post(b, "/sessions/queued/v1/chat/completions", chat)().status_code == 200
