"""A 200 MB request body is refused with 413 in the API's own error shape, before it is read
(declared length) or as soon as it passes the limit (chunked), and the server's memory stays
bounded: the issue's run grew the replica to 14 GB and left it unresponsive."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from tests.raw_http import connect, read_response
from tests.security.conftest import LiveServer, assert_responsive, health_watch

BODY = 200 * 1024 * 1024
CHUNK = b"x" * (1 << 20)


def _attack(server: LiveServer, head: bytes, frames: Iterator[bytes]) -> tuple[int, dict, int]:
    """Send `head`, then `frames` from another thread (as a client that streams its body
    whatever happens), while reading the answer here; returns status, body and bytes sent."""
    sent = 0
    with connect(server.url) as sock:
        sock.sendall(head)

        def send_body() -> None:
            nonlocal sent
            try:
                for frame in frames:
                    sock.sendall(frame)
                    sent += len(frame)
            except OSError:
                pass  # refused and closed: the rest is never read

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        status, _headers, raw = read_response(sock)
        body = json.loads(raw)
        sender.join(30)
    return status, body, sent


@pytest.mark.parametrize(
    ("path", "anthropic"),
    [("/v1/chat/completions", False), ("/sessions/big/v1/messages", True)],
)
def test_declared_200_mb_body_is_refused_before_it_is_read(
    protected: LiveServer, path: str, anthropic: bool
) -> None:
    rss_before = protected.rss_bytes()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"x-session-id: big\r\ncontent-length: {BODY}\r\n\r\n"
    ).encode()
    with health_watch(protected) as health:
        status, body, sent = _attack(protected, head, (CHUNK for _ in range(BODY // len(CHUNK))))
    assert status == 413
    assert sent < BODY
    if anthropic:
        assert body["type"] == "error"
        assert body["error"]["type"] == "request_too_large"
    else:
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == 413
    assert_responsive(health)
    assert protected.rss_bytes() - rss_before < 64 * 1024 * 1024


def test_chunked_200_mb_body_is_cut_off_at_the_limit(protected: LiveServer) -> None:
    rss_before = protected.rss_bytes()
    head = (
        b"POST /sessions/big/v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
        b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    frame = f"{len(CHUNK):x}\r\n".encode() + CHUNK + b"\r\n"
    with health_watch(protected) as health:
        status, body, sent = _attack(protected, head, (frame for _ in range(BODY // len(CHUNK))))
    assert status == 413
    assert sent < BODY
    assert body["error"]["code"] == 413
    assert_responsive(health)
    # Bounded by the 8 MiB limit (the front-end holds what it read), not by the body sent.
    assert protected.rss_bytes() - rss_before < 128 * 1024 * 1024
    with protected.client() as client:
        assert client.get("/sessions/big").status_code == 404
