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
import pytest

from session_server.api.limits import _QuoteCount
from tests.security.conftest import LiveServer, assert_responsive, chat_body, health_watch

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
        time.sleep(0.1)  # the expensive body is on the server (at most 8 MiB on loopback: ms)
        while not done.is_set():
            answer = client.send(other)
            if not done.is_set():
                during.append(answer.status_code)
            done.wait(0.05)
    thread.join(10)
    return result[0], during, time.monotonic() - started


def test_a_body_of_tiny_messages_is_refused_before_it_is_parsed(protected: LiveServer) -> None:
    """~225k tiny messages in 8 MiB: validating them is one pydantic-core call that held the
    GIL, and /healthz with it, for over a second (issue 33). They are counted as the body
    arrives (JSON strings) and refused before any parse, /healthz answering throughout."""
    body = _tiny_messages_body()  # built first: the watch polls from this process's threads
    with (
        httpx.Client(base_url=protected.url, timeout=60) as client,
        health_watch(protected) as answers,
    ):
        response = client.post(
            "/sessions/tiny-messages/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "JSON strings" in error["message"]
    assert_responsive(answers)
    with httpx.Client(base_url=protected.url, timeout=30) as client:
        assert client.get("/sessions/tiny-messages").status_code == 404


def test_quotes_inside_strings_do_not_count_as_strings(protected: LiveServer) -> None:
    """A message of 300k quote characters is one string (JSON escapes each as \\"): served,
    not refused by the strings bound."""
    body = chat_body('"' * 300_000)
    with httpx.Client(base_url=protected.url, timeout=60) as client:
        response = client.post("/sessions/many-quotes/v1/chat/completions", json=body)
    assert response.status_code != 413, response.text
    assert "JSON strings" not in response.text


@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_quote_count_is_the_same_however_the_body_is_cut(cut: int) -> None:
    body = json.dumps({"a": 'x\\"y\\\\', "b": ['"', "\\"], "c": {"d": "e"}}).encode()
    whole = _QuoteCount()
    whole.add(body)
    pieces = _QuoteCount()
    for i in range(0, len(body), cut):
        pieces.add(body[i : i + cut])
    # Keys a, b, c, d and the values: 8 strings; an escaped backslash before a closing quote
    # makes the count fall short by one, never over.
    assert whole.total == pieces.total
    assert 14 <= whole.total <= 16


def test_first_turn_tokenizing_a_long_message_does_not_block_other_sessions(
    protected: LiveServer,
) -> None:
    # Distinct words: ~0.5 s to tokenize here (encode_batch_fast); under the characters the
    # 4,096-token test context could hold (4,096 x the longest token, 128 characters), so it
    # is tokenized, and far more tokens than the context, so the turn is refused after.
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
