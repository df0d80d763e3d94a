"""The floor of a Python gateway on this machine: a minimal ASGI app under the same server
stack `tokenkeep serve` uses (uvicorn, uvloop, httptools), that reads a Chat Completions
request, sends the engine double a token prompt of the same length through one keep-alive
connection (one write, httptools' parser), and answers a fixed reply with orjson. No session
logic at all: what it costs per turn is what the server stack and the two HTTP hops cost,
which `bench_served.py` reports beside tokenkeep's figure so that a reader on another machine
can scale the absolute numbers.

Run by bench_served.py as: uvicorn bench.floor_relay:app (env FLOOR_ENGINE=host:port).
`rsgi_app` is the same relay on granian's own interface (bench/bench_front.py).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httptools
import orjson

REPLY = orjson.dumps(
    {
        "id": "chatcmpl-floor",
        "object": "chat.completion",
        "model": "floor",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "All done, the tests pass now."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 7, "total_tokens": 7},
    }
)
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(REPLY))]
RSGI_HEADERS = [("content-type", "application/json")]  # granian adds the length


class _Engine(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.done: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.lost = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True  # the engine closes idle keep-alive connections: connect again

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        done, self.done = self.done, None
        assert done is not None
        done.set_result(b"".join(self.body))
        self.body = []


_engine: _Engine | None = None


async def _generate(prompt_tokens: int) -> dict[str, Any]:
    global _engine
    loop = asyncio.get_running_loop()
    if _engine is None or _engine.lost:
        host, port = os.environ["FLOOR_ENGINE"].rsplit(":", 1)
        _, _engine = await loop.create_connection(_Engine, host, int(port))
    body = orjson.dumps(
        {
            "request_id": "floor",
            "model": "floor",
            "token_ids": list(range(prompt_tokens)),
            "sampling_params": {"max_tokens": 64, "logprobs": 0},
            "return_token_ids": True,
            "stream": False,
        }
    )
    _engine.done = loop.create_future()
    _engine.transport.write(
        b"POST /inference/v1/generate HTTP/1.1\r\nhost: engine\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return orjson.loads(await _engine.done)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] != "/healthz":
        request = orjson.loads(b"".join(chunks))
        # About as many prompt tokens as the conversation has (4 characters a token).
        await _generate(sum(len(str(m.get("content") or "")) for m in request["messages"]) // 4)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": REPLY})


async def rsgi_app(scope: Any, protocol: Any) -> None:
    """The relay on granian's RSGI interface: the body in one call, the reply in one call."""
    raw = await protocol()
    if scope.path != "/healthz":
        request = orjson.loads(raw)
        await _generate(sum(len(str(m.get("content") or "")) for m in request["messages"]) // 4)
    protocol.response_bytes(200, RSGI_HEADERS, REPLY)
