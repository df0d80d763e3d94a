"""A request that is expensive to parse or to tokenize does not stop the server: /healthz and
other sessions keep being answered while it is processed (its validation, conversion,
hashing and first-turn tokenizing run in worker threads; the tokenizer releases the GIL for
long texts). Properties over HTTP against the live `tokenkeep serve` process, not timings:
other requests are answered *while* the expensive one is still in progress."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.security.conftest import LiveServer, chat_body

LIMIT = 8 << 20
"""The default --max-body-bytes."""


def _tiny_messages_body() -> bytes:
    """Many tiny messages, just under the body limit (~225k messages)."""
    pair = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]

    def body(pairs: int) -> bytes:
        return json.dumps({"model": "m", "messages": pair * pairs}).encode()

    per_pair = len(body(2)) - len(body(1))
    raw = body((LIMIT - len(body(0)) - 1024) // per_pair)
    assert LIMIT - 4096 < len(raw) < LIMIT
    return raw


def _answers_while(server: LiveServer, expensive: httpx.Request, other: httpx.Request) -> tuple:
    """Send `expensive` from a thread; until it is answered, send `other` over and over.
    Returns (expensive response, statuses of the `other` answers that arrived before the
    expensive one was answered, its elapsed seconds)."""
    done = threading.Event()
    result: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(timeout=300) as client:
            result.append(client.send(expensive))
        done.set()

    thread = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    thread.start()
    during: list[int] = []
    with httpx.Client(timeout=30) as client:
        time.sleep(0.5)  # the expensive body is on the server (8 MiB on loopback: ms)
        while not done.is_set():
            answer = client.send(other)
            if not done.is_set():
                during.append(answer.status_code)
            done.wait(0.05)
    thread.join(10)
    return result[0], during, time.monotonic() - started


def test_healthz_answers_while_a_body_of_tiny_messages_is_parsed(protected: LiveServer) -> None:
    expensive = httpx.Request(
        "POST",
        f"{protected.url}/sessions/tiny-messages/v1/chat/completions",
        content=_tiny_messages_body(),
        headers={"content-type": "application/json"},
    )
    health = httpx.Request("GET", f"{protected.url}/healthz")
    response, during, elapsed = _answers_while(protected, expensive, health)
    # More messages than the test context (4,096 tokens) has tokens: refused, in the API's
    # own error shape, after the body was parsed (seconds of work, off the event loop).
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "messages cannot fit" in error["message"]
    # /healthz was answered over and over while it was being processed (with the parse on
    # the event loop, not one answer came back until the 400 did).
    assert len(during) >= 3, (during, elapsed)
    assert set(during) == {200}


def test_first_turn_tokenizing_a_long_message_does_not_block_other_sessions(
    protected: LiveServer,
) -> None:
    # Distinct words: ~1 s or more to tokenize here; under the characters the 4,096-token
    # test context could hold (4,096 x the longest token, 128 characters), so it is
    # tokenized, and far more tokens than the context, so the turn is refused after.
    text = " ".join(f"w{k}x{k * 7919 % 10007}" for k in range(60_000))[:500_000]
    expensive = httpx.Request(
        "POST",
        f"{protected.url}/sessions/long-first/v1/chat/completions",
        json=chat_body(text),
    )
    with httpx.Client(base_url=protected.url, timeout=30) as client:
        warm = client.post("/sessions/other-session/v1/chat/completions", json=chat_body("hi"))
    assert warm.status_code == 200, warm.text
    other = httpx.Request(
        "POST",
        f"{protected.url}/sessions/other-session/v1/chat/completions",
        json={**chat_body("hi"), "messages": [{"role": "user", "content": "hi"}]},
    )
    response, during, elapsed = _answers_while(protected, expensive, other)
    assert response.status_code == 400, response.text
    assert "context" in response.json()["error"]["message"]
    # The other session's turns (a retry of its first turn: the same stored tokens) were
    # served while the long message was being tokenized.
    assert len(during) >= 2, (during, elapsed)
    assert set(during) == {200}
