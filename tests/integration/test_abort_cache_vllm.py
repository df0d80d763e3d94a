"""Abort and prefix-cache telemetry against the real vLLM CPU engine: an aborted generation
stops at the engine (its running-request gauge drops to 0) and the cut turn keeps the tokens
that arrived; continued turns report the engine's own prefix-cache hits."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import RealStack

pytestmark = pytest.mark.vllm

LONG = {"max_tokens": 3000, "ignore_eos": True, "seed": 5}


def _running(engine_url: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


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
        deadline = time.monotonic() + 10
        while _running(real_stack.engine.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(real_stack.engine.url) == 0

        # A whole (non-streamed) request: answered with the aborted error, no tokens kept.
        answer: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answer.append(
                http.post(f"/sessions/{sid}/v1/chat/completions", json=body, headers=headers)
            )
        )
        sender.start()
        deadline = time.monotonic() + 30
        while not _running(real_stack.engine.url) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        started = time.monotonic()
        assert http.post(f"/sessions/{sid}/abort").json()["aborted"] == 1
        sender.join(30)
        whole_latency = time.monotonic() - started
        assert answer[0].status_code == 400 and answer[0].json()["error"]["type"] == "aborted"
        assert _running(real_stack.engine.url) == 0
        kinds = [t["kind"] for t in _turns(http, sid)]
        assert kinds == ["first", "retry"]
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
