"""One client must not stall a replica (issue 33, class 3): work that escaped the limits ran
on the event loop, and slow or departed clients held slots and connections for ever. Each
attack runs against the live `tokenkeep serve` process while /healthz is polled; it must keep
answering within 100 ms."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import socket
import struct
import time
import zlib
from collections.abc import Iterator

import httpx
import pytest

from tests.engine_double import EngineDouble
from tests.raw_http import connect, read_response
from tests.security.conftest import (
    LiveServer,
    assert_responsive,
    chat_body,
    health_watch,
    start_server,
    stop_server,
)

MAX_INFLIGHT = 2
MAX_QUEUE = 2
BODY_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0
HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory, double: EngineDouble) -> Iterator[LiveServer]:
    """A server with small admission bounds and short connection timeouts (environment
    variables, as the operator configures them)."""
    env = {
        "TOKENKEEP_MAX_INFLIGHT": str(MAX_INFLIGHT),
        "TOKENKEEP_MAX_QUEUE": str(MAX_QUEUE),
        "TOKENKEEP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "TOKENKEEP_KEEP_ALIVE_S": str(KEEP_ALIVE_S),
        "TOKENKEEP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "TOKENKEEP_STARTUP_CHECK": "false",
    }
    server = start_server(tmp_path_factory.mktemp("tight"), double, env=env)
    try:
        yield server
    finally:
        stop_server(server)


def _head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"x-session-id: stalls\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (it sends nothing before)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# --- slow and idle connections ----------------------------------------------------------


def test_slow_bodies_beyond_the_admission_bound_do_not_block_a_turn(tight: LiveServer) -> None:
    body = json.dumps(chat_body("hi")).encode()
    with contextlib.ExitStack() as stack, health_watch(tight) as health:
        # Headers and five bytes, ten times more than the slots and the queue together.
        for _ in range(10 * (MAX_INFLIGHT + MAX_QUEUE)):
            sock = stack.enter_context(connect(tight.url))
            sock.sendall(_head("/v1/chat/completions", len(body)) + body[:5])
        time.sleep(0.2)
        started = time.monotonic()
        with tight.client() as client:
            response = client.post(
                "/v1/chat/completions", json=chat_body("hi"), headers={"x-session-id": "normal"}
            )
        elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    # Answered while every slow body was still being waited for (before its timeout).
    assert elapsed < BODY_TIMEOUT_S / 2, elapsed
    assert_responsive(health)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/sessions/stalls/v1/messages"])
def test_a_body_that_stalls_midway_gets_a_timeout_answer(tight: LiveServer, path: str) -> None:
    body = json.dumps(chat_body("hi")).encode()
    with health_watch(tight) as health, connect(tight.url, timeout=BODY_TIMEOUT_S + 5) as sock:
        started = time.monotonic()
        sock.sendall(_head(path, len(body)) + body[: len(body) // 2])
        status, headers, raw = read_response(sock)
        elapsed = time.monotonic() - started
    assert status == 408
    assert headers["connection"] == "close"
    error = json.loads(raw)["error"]
    assert f"not received within {BODY_TIMEOUT_S:g} s" in error["message"]
    # In the API's own shape: Anthropic's names its type, OpenAI's carries a code.
    assert ("messages" in path) == (json.loads(raw).get("type") == "error")
    assert BODY_TIMEOUT_S - 0.5 < elapsed < BODY_TIMEOUT_S + 2, elapsed
    assert_responsive(health)


def test_idle_keep_alive_connections_are_closed(tight: LiveServer) -> None:
    with health_watch(tight) as health, connect(tight.url) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        status, _headers, _raw = read_response(sock)
        assert status == 200
        assert _closed_within(sock, KEEP_ALIVE_S + 2)
    assert_responsive(health)


@pytest.mark.parametrize("sent", [b"", b"GET /healthz HTTP/1.1\r\nhost: t\r\n"])
def test_connections_that_never_finish_their_headers_are_closed(
    tight: LiveServer, sent: bytes
) -> None:
    with health_watch(tight) as health, connect(tight.url) as sock:
        sock.sendall(sent)
        assert _closed_within(sock, HEADER_TIMEOUT_S + 2)
    assert_responsive(health)


def test_headers_past_the_bound_close_the_connection_at_once(tight: LiveServer) -> None:
    """A request head that keeps growing is cut at --max-header-bytes (64 KiB by default), not
    buffered until the header timeout."""
    head = b"GET /healthz HTTP/1.1\r\nhost: t\r\nx-pad: " + b"a" * (80 << 10)
    with health_watch(tight) as health, connect(tight.url) as sock:
        started = time.monotonic()
        with contextlib.suppress(ConnectionError):  # closed while it was still sending
            sock.sendall(head)
        assert _closed_within(sock, HEADER_TIMEOUT_S + 2)
        elapsed = time.monotonic() - started
    assert elapsed < HEADER_TIMEOUT_S / 2, elapsed  # the byte bound, not the timeout
    assert_responsive(health)


# --- a client that hangs up -------------------------------------------------------------


def _inflight(server: LiveServer) -> float:
    with server.client() as client:
        text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("tokenkeep_inflight_requests "))
    return float(line.split()[1])


def test_a_non_streamed_client_that_hangs_up_frees_its_slot_and_its_engine_request(
    tight: LiveServer, double: EngineDouble
) -> None:
    body = json.dumps(chat_body("hang up")).encode()
    double.latency_s = 5.0  # generating: the answer is seconds away
    cancelled = double.requests_cancelled
    try:
        with health_watch(tight) as health:
            with connect(tight.url) as sock:
                sock.sendall(_head("/v1/chat/completions", len(body)) + body)
                deadline = time.monotonic() + 3
                while _inflight(tight) < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert _inflight(tight) == 1
            hung_up = time.monotonic()
            while (
                _inflight(tight) or double.requests_cancelled == cancelled
            ) and time.monotonic() < hung_up + 3:
                time.sleep(0.05)
            freed = time.monotonic() - hung_up
    finally:
        double.latency_s = 0.0
    assert double.requests_cancelled == cancelled + 1
    assert _inflight(tight) == 0
    assert freed < 1.0, freed  # not when the engine would have answered (5 s)
    assert_responsive(health)


# --- images -----------------------------------------------------------------------------


@functools.cache
def _blank_png(width: int, height: int, rows: int | None = None) -> bytes:
    """A 1-bit PNG declaring `width` x `height`, of blank rows (all of them by default: a
    few KB that decode to width x height pixels, a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    row = b"\0" * (1 + (width + 7) // 8)
    packer = zlib.compressobj(9)
    pixels = b"".join(packer.compress(row) for _ in range(rows or height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def _with_images(*pngs: bytes) -> dict:
    parts = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()},
        }
        for p in pngs
    ]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


def _post_timed(server: LiveServer, body: dict) -> tuple[httpx.Response, float]:
    with server.client() as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json=body, headers={"x-session-id": "img"})
    return response, time.monotonic() - started


@pytest.mark.parametrize(
    ("png", "reason"),
    [
        # Decodes to 64 Mi pixels: refused from its header, before a pixel is decoded.
        (_blank_png(8192, 8192), "image is 8192x8192; at most 33554432 pixels"),
        # Past PIL's own bomb bound: its DecompressionBombError, answered 400, not 500.
        (_blank_png(20000, 20000, rows=1), "image cannot be decoded: Image size"),
    ],
    ids=["8192x8192", "20000x20000"],
)
def test_a_decompression_bomb_png_is_refused_from_its_header(
    tight: LiveServer, png: bytes, reason: str
) -> None:
    assert len(png) < 16 << 10
    with health_watch(tight) as health:
        response, elapsed = _post_timed(tight, _with_images(png))
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]
    assert elapsed < 0.5, elapsed
    assert_responsive(health)


def test_many_images_for_a_text_only_model_are_refused_before_decoding(
    tight: LiveServer,
) -> None:
    # Under the per-request count, each under the pixel bound: 16 Mi pixels (~0.1 s to
    # decode here) in 2 KB, all different (decoded images are remembered by their hash).
    pngs = [_blank_png(4096, 4096 - k) for k in range(24)]
    with health_watch(tight) as health:
        response, elapsed = _post_timed(tight, _with_images(*pngs))
    assert response.status_code == 400, response.text
    assert "takes no images (text-only)" in response.json()["error"]["message"]
    assert elapsed < 0.5, elapsed
    assert_responsive(health)


def test_more_images_than_the_bound_are_refused_before_any_is_decoded(
    tight: LiveServer,
) -> None:
    pngs = [_blank_png(64, 64 + k) for k in range(65)]
    with health_watch(tight) as health:
        response, _elapsed = _post_timed(tight, _with_images(*pngs))
    assert response.status_code == 400, response.text
    assert "65 images in one request; at most 64" in response.json()["error"]["message"]
    assert_responsive(health)


# --- tools --------------------------------------------------------------------------------


def test_tools_count_against_the_text_limit(tight: LiveServer) -> None:
    # Distinct words, more characters than the 4,096-token test context could carry
    # (4,096 x its longest token): seconds to render and tokenize, were they not counted.
    text = " ".join(f"w{k}x{k * 7919 % 10007}" for k in range(80_000))[:600_000]
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look something up",
            "parameters": {"type": "object", "properties": {"q": {"description": text}}},
        },
    }
    with health_watch(tight) as health:
        response, elapsed = _post_timed(tight, {**chat_body("hi"), "tools": [tool]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "characters cannot fit the model's context" in error["message"]
    assert elapsed < 0.5, elapsed
    assert_responsive(health)
