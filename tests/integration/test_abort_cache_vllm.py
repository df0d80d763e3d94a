"""Abort and prefix-cache telemetry against the real vLLM CPU engine: an aborted generation
stops at the engine (its running-request gauge drops to 0) and the cut turn keeps the tokens
that arrived; continued turns report the engine's own prefix-cache hits."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from session_server.app import create_app
from session_server.settings import Settings
from tests.integration.conftest import RealStack
from tests.live_server import serving

pytestmark = pytest.mark.vllm

LONG = {"max_tokens": 3000, "ignore_eos": True, "seed": 5}


def _running(engine_url: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def _until_idle(engine_url: str) -> None:
    """vLLM notices a closed connection within a few of its own polls: wait for that."""
    deadline = time.monotonic() + 10
    while _running(engine_url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(engine_url) == 0


def _session(http: httpx.Client, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    return http.post("/sessions", json={"sampling": sampling or {"seed": 3}}).json()


def _turns(http: httpx.Client, session_id: str) -> list[dict[str, Any]]:
    trajectory = http.get(f"/sessions/{session_id}/trajectory").json()
    return [
        turn
        for branch in trajectory["branches"]
        for segment in branch["segments"]
        for turn in segment["turns"]
    ]


def test_abort_stops_a_streamed_and_a_whole_generation_at_the_engine(
    real_stack: RealStack,
) -> None:
    with real_stack.http() as http:
        session = _session(http, LONG)
        sid = session["id"]
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell a story."}]}
        received: list[int] = []
        latency: list[float] = []
        with http.stream(
            "POST",
            f"/sessions/{sid}/v1/chat/completions",
            json={**body, "stream": True, "return_token_ids": True},
            headers=headers,
        ) as response:
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: {") and '"token_ids"' in line:
                    choice = json.loads(line[6:])["choices"][0]
                    received.extend(choice.get("token_ids") or [])
                if len(received) >= 8 and not latency:
                    latency.append(time.monotonic())
                    threading.Thread(
                        target=lambda: http.post(f"/sessions/{sid}/abort"), daemon=True
                    ).start()
            latency[0] = time.monotonic() - latency[0]
        assert any('"aborted"' in line for line in lines[-3:]), lines[-3:]
        [turn] = _turns(http, sid)
        assert turn["finish_reason"] == "abort"
        cut = turn["completion_span"][1] - turn["completion_span"][0]
        assert 8 <= cut < 3000 and cut >= len(received)
        _until_idle(real_stack.engine.url)

        # A whole (non-streamed) request, straight to the engine (the recording relay does
        # not pass a client's disconnect on for a whole response): answered with the
        # aborted error, no tokens kept, and vLLM stops generating.
        engine = real_stack.engine
        settings = Settings(
            engine_urls=[engine.url],
            model=engine.served_model_name,
            tokenizer=str(engine.model_dir),
            context_length=engine.max_model_len,
            sampling_overrides=LONG,
        )
        answer: list[httpx.Response] = []
        with (
            serving(create_app(settings)) as direct,
            httpx.Client(base_url=direct, timeout=120) as client,
        ):
            sender = threading.Thread(
                target=lambda: answer.append(
                    client.post("/sessions/whole/v1/chat/completions", json=body)
                )
            )
            sender.start()
            deadline = time.monotonic() + 30
            while not _running(engine.url) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            started = time.monotonic()
            assert client.post("/sessions/whole/abort").json()["aborted"] == 1
            sender.join(30)
            whole_latency = time.monotonic() - started
            assert answer[0].status_code == 400
            assert answer[0].json()["error"]["type"] == "aborted"
            _until_idle(engine.url)
            assert [t["finish_reason"] for t in _turns(client, "whole")] == ["abort"]
        print(
            f"\nabort latency (real vLLM): stream {latency[0]:.3f} s, whole {whole_latency:.3f} s"
        )


def test_continued_turns_report_the_engines_prefix_cache_hits(real_stack: RealStack) -> None:
    with real_stack.http() as http:
        session = _session(http)
        client = real_stack.openai(session)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You answer briefly. " * 40},
            {"role": "user", "content": "Hello."},
        ]
        for i in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": f"And {i}?"},
            ]
        turns = _turns(http, session["id"])
        cached = [t["cached_tokens"] for t in turns]
        assert all(isinstance(c, int) for c in cached)
        # Each continued turn's prompt starts with what the previous request computed: vLLM
        # serves its full blocks from the cache (never more than the prompt).
        assert cached[0] == 0
        for previous, turn in itertools.pairwise(turns):
            assert 0 < turn["cached_tokens"] <= previous["completion_span"][1]
        ratio = http.get(f"/sessions/{session['id']}").json()["prefix_cache_hit_ratio"]
        assert ratio is not None and ratio > 0.3
        print(f"\nprefix cache on real vLLM CPU: cached {cached}, hit ratio {ratio}")


def test_an_abort_through_another_replica_stops_the_generation_at_the_engine(
    real_stack: RealStack, redis_server: str
) -> None:
    """Two session servers sharing Redis, straight to the real engine: the abort goes to A,
    the long generation runs on B; B cuts it (the abort is recorded in Redis), answers its
    client with the aborted error, and vLLM stops generating."""
    engine = real_stack.engine
    settings = Settings(
        engine_urls=[engine.url],
        model=engine.served_model_name,
        tokenizer=str(engine.model_dir),
        context_length=engine.max_model_len,
        sampling_overrides=LONG,
        redis_url=redis_server,
    )
    sid = f"replicas-{uuid.uuid4().hex[:8]}"
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell a story."}]}
    answer: list[httpx.Response] = []
    with (
        serving(create_app(settings)) as a,
        serving(create_app(settings)) as b,
        httpx.Client(timeout=120) as client,
    ):
        sender = threading.Thread(
            target=lambda: answer.append(
                client.post(f"{b}/sessions/{sid}/v1/chat/completions", json=body)
            )
        )
        sender.start()
        deadline = time.monotonic() + 30
        while not _running(engine.url) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        started = time.monotonic()
        assert client.post(f"{a}/sessions/{sid}/abort").json()["aborted"] == 0
        sender.join(30)
        latency = time.monotonic() - started
        assert answer[0].status_code == 400
        assert answer[0].json()["error"]["type"] == "aborted"
        _until_idle(engine.url)
        trajectory = client.get(f"{a}/sessions/{sid}/trajectory").json()
        [turn] = trajectory["branches"][0]["segments"][0]["turns"]
        assert turn["finish_reason"] == "abort"
    print(f"\nabort latency across replicas (real vLLM): whole {latency:.3f} s")
